"""OPT (facebook/opt-*): learned positions (offset 2), LayerNorm, ReLU MLP, tied LM head.

``do_layer_norm_before`` picks pre-norm (125m, 1.3b+) or post-norm (350m) blocks; when
``word_embed_proj_dim`` differs from ``hidden_size`` the embeddings are projected in and
out (350m). Parameter names follow HF: ``model.decoder.{embed_tokens, embed_positions,
project_in, project_out, final_layer_norm}``, ``model.decoder.layers.N.{self_attn.{q,k,v,
out}_proj, self_attn_layer_norm, fc1, fc2, final_layer_norm}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models.base import (
    BaseModelArgs,
    KVCache,
    cached_attention,
    select_rows,
    split_hidden_rows,
)
from mlxserve.ops import AttentionMetadata

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq leftover)
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "relu": nn.relu,
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
}


@dataclass
class ModelArgs(BaseModelArgs):
    """OPT config.json keys (HF names)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    ffn_dim: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    activation_function: str = "relu"
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    remove_final_layer_norm: bool = False
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """As BaseModelArgs.from_dict, also reading HF's ``_remove_final_layer_norm``."""
        config = dict(config)
        if "_remove_final_layer_norm" in config:
            config.setdefault("remove_final_layer_norm", config["_remove_final_layer_norm"])
        return super().from_dict(config)

    def __post_init__(self) -> None:
        if self.word_embed_proj_dim is None:
            self.word_embed_proj_dim = self.hidden_size
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(
                f"activation_function {self.activation_function!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )


class Attention(nn.Module):
    """Multi-head self-attention of one layer over the paged KV cache."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        dim = args.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim, bias=args.enable_bias)
        self.k_proj = nn.Linear(dim, dim, bias=args.enable_bias)
        self.v_proj = nn.Linear(dim, dim, bias=args.enable_bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.enable_bias)

    def __call__(
        self, x: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        num_tokens = x.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        q = self.q_proj(x).reshape(shape)
        k = self.k_proj(x).reshape(shape)
        v = self.v_proj(x).reshape(shape)
        out = cached_attention(cache, self.layer_idx, q, k, v, md, self.scale)
        return self.out_proj(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    """Attention then MLP, each with a residual; LayerNorm before (pre-norm) or after."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        dim, affine = args.hidden_size, args.layer_norm_elementwise_affine
        self.pre_norm = args.do_layer_norm_before
        self.activation = ACTIVATIONS[args.activation_function]
        self.self_attn = Attention(args, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(dim, affine=affine)
        self.fc1 = nn.Linear(dim, args.ffn_dim, bias=args.enable_bias)
        self.fc2 = nn.Linear(args.ffn_dim, dim, bias=args.enable_bias)
        self.final_layer_norm = nn.LayerNorm(dim, affine=affine)

    def __call__(
        self, x: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        h = x + self.self_attn(h, md, cache)
        if not self.pre_norm:
            h = self.self_attn_layer_norm(h)
        r = self.final_layer_norm(h) if self.pre_norm else h
        h = h + self.fc2(self.activation(self.fc1(r)))
        return h if self.pre_norm else self.final_layer_norm(h)


class Decoder(nn.Module):
    """``model.decoder``: embeddings, optional projections, layers, optional final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, embed_dim = args.hidden_size, args.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(args.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(args.max_position_embeddings + POSITION_OFFSET, dim)
        if embed_dim != dim:
            self.project_in = nn.Linear(embed_dim, dim, bias=False)
            self.project_out = nn.Linear(dim, embed_dim, bias=False)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        if args.do_layer_norm_before and not args.remove_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(dim, affine=args.layer_norm_elementwise_affine)

    def __call__(
        self,
        input_ids: mx.array,
        positions: mx.array,
        md: AttentionMetadata,
        cache: KVCache,
        logits_indices: mx.array | None,
    ) -> mx.array:  # (num_rows, word_embed_proj_dim)
        h = self.embed_tokens(input_ids)  # (num_tokens, word_embed_proj_dim)
        if "project_in" in self:
            h = self.project_in(h)  # (num_tokens, hidden)
        h = h + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            h = layer(h, md, cache)
        h = select_rows(h, logits_indices)
        if "final_layer_norm" in self:
            h = self.final_layer_norm(h)
        if "project_out" in self:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    """``model``: holds the decoder (HF nesting)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.decoder = Decoder(args)


class Model(nn.Module):
    """OPT causal LM on a flat token axis: ``model(input_ids, positions, md, kv_cache)``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.num_layers = args.num_hidden_layers
        self.num_kv_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.vocab_size = args.vocab_size
        self.max_position_embeddings = args.max_position_embeddings
        self.model = OPTModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.word_embed_proj_dim, args.vocab_size, bias=False)

    def __call__(
        self,
        input_ids: mx.array,  # (num_tokens,) int32
        positions: mx.array,  # (num_tokens,) int32
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: mx.array | None = None,  # (num_rows,) int32
        num_hidden_rows: int = 0,
    ) -> mx.array | tuple[mx.array, mx.array]:  # (num_rows or num_tokens, vocab_size)
        """Logits of the selected rows; with ``num_hidden_rows``, the last that many selected
        rows come back as final hidden states instead: ``(logits, hidden)`` (embeddings)."""
        decoder = self.model.decoder
        h = decoder(input_ids, positions, attn_metadata, kv_cache, logits_indices)
        h, hidden = split_hidden_rows(h, num_hidden_rows)
        head = decoder.embed_tokens.as_linear if self.args.tie_word_embeddings else self.lm_head
        return head(h) if hidden is None else (head(h), hidden)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Accept fairseq-style ``decoder.*`` names; drop the tied LM head."""
        tied = self.args.tie_word_embeddings
        out = {}
        for key, value in weights.items():
            if key.startswith("decoder."):
                key = "model." + key
            if tied and key.startswith("lm_head."):
                continue
            out[key] = value
        return out
