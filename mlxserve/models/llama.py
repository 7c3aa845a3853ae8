"""Llama 2/3/3.x, Mistral, SmolLM/SmolLM2, TinyLlama: the pre-norm RMSNorm + SwiGLU decoder.

The decoder classes here are shared by qwen2 and qwen3, which differ only in their
ModelArgs (bias layout, per-head q/k norms). Parameter names follow the HF checkpoints::

    model.embed_tokens
    model.layers.N.{input_layernorm, post_attention_layernorm}
    model.layers.N.self_attn.{q,k,v,o}_proj [.q_norm, .k_norm]
    model.layers.N.mlp.{gate,up,down}_proj
    model.norm, lm_head (absent when tied)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models import compiled
from mlxserve.models.base import (
    BaseModelArgs,
    KVCache,
    cached_attention,
    context_limit,
    select_rows,
    split_hidden_rows,
)
from mlxserve.models.layers import RMSNorm, RotaryEmbedding, resolve_rope
from mlxserve.module_changes import Watched
from mlxserve.ops import AttentionMetadata


@dataclass
class ModelArgs(BaseModelArgs):
    """Llama-family config.json keys (HF names)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float | None = None
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    hidden_act: str = "silu"

    default_rope_theta = 10000.0

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_attention_heads ({self.num_attention_heads}) when head_dim is not set"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.rope_theta, self.rope_scaling, self.rope_parameters, self.default_rope_theta
        )

    # Layout switches the shared decoder reads; qwen2/qwen3 override them.
    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def use_qk_norm(self) -> bool:
        return False

    @property
    def context_len(self) -> int | None:
        """Context computed exactly (a sliding window, if any, caps it)."""
        uses_window = self.layer_types is None or "sliding_attention" in self.layer_types
        return context_limit(
            self.max_position_embeddings, self.sliding_window if uses_window else None
        )


class Attention(Watched):
    """Self-attention of one layer over the paged KV cache."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim, q_dim, kv_dim = (
            args.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(dim, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(dim, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(dim, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, dim, bias=args.o_bias)
        if args.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = RotaryEmbedding(
            self.head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling
        )

    def __call__(
        self,
        x: mx.array,  # (num_tokens, hidden)
        positions: mx.array,  # (num_tokens,)
        md: AttentionMetadata,
        cache: KVCache,
    ) -> mx.array:  # (num_tokens, hidden)
        out = self.attend(self.project(x, positions), md, cache)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def project(
        self,
        x: mx.array,  # (num_tokens, hidden)
        positions: mx.array,  # (num_tokens,)
    ) -> list[mx.array]:  # q (num_tokens, num_heads, head_dim), k, v (.., num_kv_heads, ..)
        """q, k and v of the (normed) input rows, rotated."""
        num_tokens = x.shape[0]
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        if "qkv_proj" in self and "q_norm" not in self:  # fused at load (models/fused.py)
            dims = (self.head_dim,) * 3  # split, reshaped and q, k rotated (one op on the CPU)
            return self.rope.split_rotate(self.qkv_proj(x), positions, heads, dims, 2)
        if "qkv_proj" in self:
            q, k, v = mx.split(self.qkv_proj(x), self._qkv_split, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return [self.rope(q, positions), self.rope(k, positions), v]

    def attend(
        self, qkv: list[mx.array], md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, num_heads, head_dim)
        """Write k and v to the cache, then attend over each row's context."""
        q, k, v = qkv
        return cached_attention(cache, self.layer_idx, q, k, v, md, self.scale)

    def fuse_qkv(self, qkv_proj: nn.Module, sizes: list[int]) -> None:
        """Replace q/k/v_proj by one layer whose output rows are q | k | v (``sizes``)."""
        del self["q_proj"], self["k_proj"], self["v_proj"]
        self.qkv_proj = qkv_proj
        self._qkv_split = [sizes[0], sizes[0] + sizes[1]]


class MLP(Watched):
    """SwiGLU feed-forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.up_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden, dim, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:  # fused at load (models/fused.py)
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(compiled.swiglu(gate, up))

    def fuse_gate_up(self, gate_up_proj: nn.Module) -> None:
        """Replace gate/up_proj by one layer whose output rows are gate | up."""
        del self["gate_proj"], self["up_proj"]
        self.gate_up_proj = gate_up_proj


class DecoderLayer(Watched):
    """Pre-norm attention block followed by a pre-norm MLP block."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args)

    def __call__(
        self, x: mx.array, positions: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        h = x + self.self_attn(self.input_layernorm(x), positions, md, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """Embeddings, layers and the final norm (``model.*`` in checkpoints)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        # One RoPE for all layers (they are configured alike): on the CPU it computes a
        # step's cos/sin tables once, not once per layer.
        for layer in self.layers[1:]:
            layer.self_attn.rope = self.layers[0].self_attn.rope
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        input_ids: mx.array,
        positions: mx.array,
        md: AttentionMetadata,
        cache: KVCache,
        logits_indices: mx.array | None,
    ) -> mx.array:  # (num_rows, hidden)
        h = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        h = self.run_layers(h, positions, md, cache)
        return self.norm(select_rows(h, logits_indices))

    def run_layers(
        self, h: mx.array, positions: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        """The decoder layers, in order."""
        for layer in self.layers:
            h = layer(h, positions, md, cache)
        return h


class Model(nn.Module):
    """Causal LM on a flat token axis: ``model(input_ids, positions, md, kv_cache) -> logits``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.num_layers = args.num_hidden_layers
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.vocab_size = args.vocab_size
        self.max_position_embeddings = args.context_len
        self.model = DecoderStack(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

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
        h = self.model(input_ids, positions, attn_metadata, kv_cache, logits_indices)
        h, hidden = split_hidden_rows(h, num_hidden_rows)
        head = self.model.embed_tokens.as_linear if self.args.tie_word_embeddings else self.lm_head
        return head(h) if hidden is None else (head(h), hidden)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop precomputed rotary tables, and the LM head when it is tied to the embeddings."""
        tied = self.args.tie_word_embeddings
        return {
            k: v
            for k, v in weights.items()
            if not k.endswith("rotary_emb.inv_freq") and not (tied and k.startswith("lm_head."))
        }
