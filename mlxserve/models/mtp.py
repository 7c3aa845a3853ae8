"""Multi-token-prediction (MTP) layers shipped in a checkpoint, as a module of their own.

DeepSeek-V3-style checkpoints (GLM-4.5/4.6 ``glm4_moe``, MiMo ``mimo``) carry
``num_nextn_predict_layers`` extra layers after the decoder stack, trained to predict the
token after next. mlx-lm's ``sanitize()`` drops them; mlxserve reads them back from the
checkpoint when ``--speculative-config '{"method": "mtp"}'`` asks for them. One MTP layer,
at position i::

    e = norm_e(embed(x[i+1]))            x[i+1]: the token after position i (0 at position 0)
    h = norm_h(hidden[i])                hidden[i]: the target's last hidden state at i,
                                         before its final norm
    g = block(proj(cat(e, h)))           one decoder layer of the model's own kind, with a
                                         KV cache of its own; MiMo: cat(h, e), then
                                         g = final_layernorm(g)
    logits = head(norm_out(g))           predicts x[i+2]; GLM: shared_head.norm/.head,
                                         MiMo: the target's lm_head on g

Drafting k > 1 tokens feeds g back as the next position's ``hidden`` (vLLM's recursion;
worker/mtp.py). The embedding at position 0 is zeroed as vLLM's glm4_moe_mtp / mimo_mtp
(written by the model authors) do.

Weight names per model_type (HF checkpoints):

- glm4_moe: ``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,
  embed_tokens}`` and the block's own names under ``model.layers.{N}.`` (N =
  num_hidden_layers; experts ``mlp.experts.{e}.*`` are stacked as mlx-lm stacks them).
- mimo: ``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,
  final_layernorm}`` and the block's names under ``model.mtp_layers.{i}.``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models.base import KVCache
from mlxserve.models.mlx_lm_adapter import (
    DECODER_NAMES,
    MlxLmModel,
    UnsupportedModelError,
    run_paged_layer,
)
from mlxserve.ops import AttentionMetadata


@dataclass(frozen=True)
class MtpNames:
    """Where one architecture keeps its MTP layer's weights, and how it combines inputs."""

    prefix: str  # the layer's weights start with prefix.format(n=num_hidden_layers, i=0)
    renames: dict[str, str]  # checkpoint name (under the prefix) -> this module's
    hidden_first: bool  # cat(h, e) (MiMo) instead of cat(e, h) (DeepSeek, GLM)
    norm_output: bool  # g itself is normed (MiMo's final_layernorm), not only the head's input


MTP_ARCHITECTURES: dict[str, MtpNames] = {
    "glm4_moe": MtpNames(
        "model.layers.{n}.",
        {
            "enorm": "enorm",
            "hnorm": "hnorm",
            "eh_proj": "eh_proj",
            "shared_head.norm": "out_norm",
            "shared_head.head": "head",
            "embed_tokens": "embed",
        },
        hidden_first=False,
        norm_output=False,
    ),
    "mimo": MtpNames(
        "model.mtp_layers.{i}.",
        {
            "token_layernorm": "enorm",
            "hidden_layernorm": "hnorm",
            "input_proj": "eh_proj",
            "final_layernorm": "out_norm",
        },
        hidden_first=True,
        norm_output=True,
    ),
}
_EXPERT_PARTS = ("gate_proj", "down_proj", "up_proj")


class _Shared:
    """The target's embedding and LM head, used but not owned (not in parameters())."""

    def __init__(self, lm: nn.Module) -> None:
        self.embed = _decoder(lm).embed_tokens
        head = getattr(lm, "lm_head", None)
        self.head = head if head is not None else self.embed.as_linear


class MtpLayer(nn.Module):
    """One MTP layer on the paged pool: ``forward`` gives g per row, ``logits`` the
    prediction from g."""

    def __init__(self, target: MlxLmModel, names: MtpNames, block: nn.Module, weights) -> None:
        super().__init__()
        args = target.model.args
        hidden_size, eps = args.hidden_size, args.rms_norm_eps
        self.model_type = target.model_type
        self.names = names
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.out_norm = nn.RMSNorm(hidden_size, eps=eps)
        if "head.weight" in weights:  # GLM's own shared head (a copy of lm_head)
            self.head = nn.Linear(hidden_size, weights["head.weight"].shape[0], bias=False)
        if "embed.weight" in weights:
            self.embed = nn.Embedding(*weights["embed.weight"].shape)
        self._shared = _Shared(target.model)
        spec = target.cache_specs[0]
        self.spec = spec
        self.num_layers = 1
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.k_head_dim
        self.hidden_size = hidden_size
        self.vocab_size = target.vocab_size

    def forward(
        self,
        token_ids: mx.array,  # (T,) int32: the token after each row's position
        positions: mx.array,  # (T,) int32
        hidden: mx.array,  # (T, hidden): the target's pre-norm state (or g) at each row
        md: AttentionMetadata,
        kv_cache: KVCache,
    ) -> mx.array:  # (T, hidden): g
        embed = self.embed if "embed" in self else self._shared.embed
        e = embed(token_ids)  # (T, hidden)
        e = mx.where((positions == 0)[:, None], mx.zeros_like(e), e)
        e, h = self.enorm(e), self.hnorm(hidden.astype(e.dtype))
        x = self.eh_proj(mx.concatenate([h, e] if self.names.hidden_first else [e, h], axis=-1))
        g = run_paged_layer(self.block, x, positions, md, kv_cache, self.spec, self.model_type)
        return self.out_norm(g) if self.names.norm_output else g

    def logits(self, g: mx.array) -> mx.array:  # (N, hidden) -> (N, vocab)
        """The layer's prediction of the token two positions on."""
        head = self.head if "head" in self else self._shared.head
        return head(g if self.names.norm_output else self.out_norm(g))

    def __call__(
        self,
        input_ids: mx.array,
        positions: mx.array,
        md: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: mx.array | None = None,
        **_: object,
    ) -> mx.array:
        """A drafter-shaped forward for memory probing: zero hidden states in."""
        hidden = mx.zeros((input_ids.shape[0], self.hidden_size))
        g = self.forward(input_ids, positions, hidden, md, kv_cache)
        return self.logits(g if logits_indices is None else g[logits_indices])


def _decoder(lm: nn.Module) -> nn.Module:
    children = lm.children()
    return next(children[n] for n in DECODER_NAMES if isinstance(children.get(n), nn.Module))


def mtp_weight_names(model_type: str, config: dict, names: list[str]) -> list[str]:
    """The checkpoint's tensors of the first MTP layer (empty: the checkpoint has none)."""
    arch = MTP_ARCHITECTURES.get(model_type)
    if arch is None:
        return []
    prefix = arch.prefix.format(n=config["num_hidden_layers"], i=0)
    return [n for n in names if n.startswith(prefix)]


def build_mtp_layer(
    target: MlxLmModel, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype | None
) -> MtpLayer:
    """The first MTP layer of ``weights`` (the checkpoint's tensors, HF names) for ``target``,
    loaded strictly (quantized where the checkpoint is)."""
    from mlxserve.models import load_weights_strict
    from mlxserve.models.mlx_lm_zoo import quantize_like_mlx_lm

    model_type = target.model_type
    arch = MTP_ARCHITECTURES[model_type]
    prefix = arch.prefix.format(n=config["num_hidden_layers"], i=0)
    own: dict[str, mx.array] = {}
    for name, w in weights.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        module, _, leaf = rest.rpartition(".")
        if "rotary_emb" in rest:
            continue
        own[f"{arch.renames[module]}.{leaf}" if module in arch.renames else f"block.{rest}"] = w
    _stack_experts(own, config)
    module = importlib.import_module(type(target.model).__module__)
    args = target.model.args
    if model_type == "glm4_moe":
        block = module.DecoderLayer(args, config["num_hidden_layers"])
    else:
        block = module.TransformerBlock(args)
    layer = MtpLayer(target, arch, block, own)
    quantize_like_mlx_lm(layer, config, own)
    load_weights_strict(layer, own, dtype)
    layer.eval()
    mx.eval(layer.parameters())
    return layer


def _stack_experts(weights: dict[str, mx.array], config: dict) -> None:
    """``block.mlp.experts.{e}.{part}.*`` -> ``block.mlp.switch_mlp.{part}.*`` (mlx-lm's)."""
    n = config.get("n_routed_experts") or 0
    for part in _EXPERT_PARTS:
        for kind in ("weight", "scales", "biases"):
            name = f"block.mlp.experts.{{}}.{part}.{kind}"
            if name.format(0) in weights:
                stacked = [weights.pop(name.format(e)) for e in range(n)]
                weights[f"block.mlp.switch_mlp.{part}.{kind}"] = mx.stack(stacked)


# ---- the target's pre-norm hidden states ---------------------------------------------------
_PRENORM: ContextVar[list[mx.array] | None] = ContextVar("mlxserve_prenorm", default=None)


def hook_final_norm(target: MlxLmModel) -> None:
    """Let :func:`capture_prenorm` see the input of the decoder stack's final norm (every
    row's last hidden state). Outside a capture it costs one context-variable read."""
    stack = _decoder(target.model)
    norm = stack.children().get("norm")
    if not isinstance(norm, nn.Module) or stack.children().get("layers") is None:
        raise UnsupportedModelError(
            f"{target.model_type}: MTP needs the decoder stack's final norm ('norm')"
        )
    base = type(norm)
    if getattr(base, "_mlxserve_records_input", False):
        return

    def __call__(self, x):
        box = _PRENORM.get()
        if box is not None:
            box.append(x)  # (num_tokens, 1, hidden)
        return base.__call__(self, x)

    norm.__class__ = type(
        base.__name__, (base,), {"__call__": __call__, "_mlxserve_records_input": True}
    )


@contextmanager
def capture_prenorm() -> Iterator[list[mx.array]]:
    """Collect the final norm's input of the forward passes run inside (hook_final_norm)."""
    box: list[mx.array] = []
    token = _PRENORM.set(box)
    try:
        yield box
    finally:
        _PRENORM.reset(token)


__all__ = [
    "MTP_ARCHITECTURES",
    "MtpLayer",
    "build_mtp_layer",
    "capture_prenorm",
    "hook_final_norm",
    "mtp_weight_names",
]
