"""A llama-family model's decoder layers in one op on MLX's CPU backend
(csrc/decoder_stack_ext.cpp).

With each layer one op (cpu/layer.py), a step still paid ~30 us of Python per layer
to describe it (module lookups, the weight lists and keyword arguments, the call) and MLX
~7-9 us to dispatch it. Here the layers' weights and settings are read and checked once
and kept (:class:`StackArgs`, held by the decoder stack or pipeline stage cpu/install.py
bound this onto), and a step is one call::

    x, k_pools, v_pools -> decoder_stack -> h, k_pools, v_pools
        each layer as the one-op layer computes it, in order (the same bits, pools included)

What is kept is made again when any module it was read from changed (``load_weights``,
``update``, fusing, sharding: module_changes.Watched counts the changes) or the layers are
others: the op never runs weights the model no longer has. Where the one-op layer would
not apply to every layer (see :func:`decoder_stack`) this returns None and the layers run
one by one.
"""

from __future__ import annotations

import operator
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve import module_changes, ops
from mlxserve.cpu import layer as cpu_layer
from mlxserve.cpu import ops as cpu_ops
from mlxserve.module_changes import Watched
from mlxserve.ops import AttentionMetadata

__all__ = ["StackArgs", "decoder_stack"]

_POOL_DTYPES = (mx.float32, mx.int8)


class StackArgs:
    """A stack's kept arguments: the extension's layers (None: the stack does not apply to
    these layers), the shared RoPE, and what they were made from (the layers, the change
    count) to know when to make them again. A plain object: never a module parameter."""

    __slots__ = ("layers", "made_from", "num_made", "rope", "version")

    def __init__(self) -> None:
        self.made_from: list[nn.Module] = []
        self.version = -1
        self.layers: Any = None  # the extension's DecoderStackLayers
        self.rope: nn.Module | None = None
        self.num_made = 0  # how many times made (the tests' view of the cache)

    def current(self, layers: list[nn.Module]) -> bool:
        """Whether these were made from ``layers`` as they are now."""
        return (
            self.version == module_changes.count()
            and len(layers) == len(self.made_from)
            and all(map(operator.is_, layers, self.made_from))
        )

    def make(self, module: ModuleType, layers: list[nn.Module]) -> None:
        """Read and check every layer's weights and settings (None where any layer's
        one-op layer would not apply)."""
        version = module_changes.count()
        self.layers = self.rope = None  # (until made: a failed check keeps nothing old)
        self.version, self.made_from = -1, []
        self.num_made += 1
        parts = [_stack_layer(module, layer, i) for i, layer in enumerate(layers)]
        if (
            parts
            and None not in parts
            and all(layer.self_attn.rope is layers[0].self_attn.rope for layer in layers)
        ):  # (one RoPE: the step's cos and sin are made once)
            self.layers = module.decoder_stack_layers(parts)
            self.rope = layers[0].self_attn.rope
        self.version, self.made_from = version, list(layers)


def _stack_layer(module: ModuleType, layer: nn.Module, index: int) -> Any:
    """The extension's StackLayer of ``layer`` (the ``index``-th: its K/V pools' index), or
    None where decoder_layer would not apply to it or a module it reads does not count its
    changes."""
    if not cpu_layer.attends_as_llama(layer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if attn.layer_idx != index:
        return None
    if "qkv_proj" not in attn or "gate_up_proj" not in mlp:
        return None
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    qk_norms = [attn.q_norm, attn.k_norm] if "q_norm" in attn else []
    watched = [layer, attn, mlp, norm, post, attn.rope, *qk_norms]
    if not all(isinstance(m, Watched) for m in watched):
        return None
    linears = [cpu_layer.linear_args(m) for m in (attn.qkv_proj, attn.o_proj)]
    linears += [cpu_layer.linear_args(m) for m in (mlp.gate_up_proj, mlp.down_proj)]
    if None in linears:
        return None
    if qk_norms and attn.q_norm.eps != attn.k_norm.eps:
        return None
    (qkv, qkv_set), (o, o_set), (gate_up, gate_up_set), (down, down_set) = linears
    return module.stack_layer(
        norm_weight=norm["weight"], eps=norm.eps, qkv=qkv, qkv_settings=qkv_set,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        rope_dims=attn.rope.dims, traditional=attn.rope.traditional,
        qk_norms=[m["weight"] for m in qk_norms], qk_eps=qk_norms[0].eps if qk_norms else 0.0,
        scale=attn.scale, o=o, o_settings=o_set, post_norm_weight=post["weight"],
        post_eps=post.eps, gate_up=gate_up, gate_up_settings=gate_up_set, down=down,
        down_settings=down_set,
    )  # fmt: skip


def decoder_stack(
    args: StackArgs,
    layers: list[nn.Module],  # models.llama.DecoderLayer, layer i's pools at cache index i
    x: mx.array,  # (num_tokens, hidden)
    positions: mx.array,  # (num_tokens,) int32
    md: AttentionMetadata,
    cache: Any,  # models.base.KVCache: its pools are replaced by the written ones
) -> mx.array | None:  # (num_tokens, hidden): the last layer's output
    """Every layer in one op, or None where the one-op layer would not apply to each
    (as cpu_layer.decoder_layer: float32 activations, the kernels' fused projections,
    float32 or int8 pools, int32 slots, the llama attention) or the cache holds other pools
    than one pair per layer: then the layers run one by one."""
    if x.dtype != mx.float32 or md.slot_mapping.dtype != mx.int32:
        return None
    module = ops.cpu_module()
    keys, values = cache.keys, cache.values
    if module is None or len(keys) != len(layers) or len(values) != len(layers):
        return None
    if not args.current(layers):
        args.make(module, layers)
    if args.layers is None:
        return None
    dtype = keys[0].dtype
    if dtype not in _POOL_DTYPES or any(p.dtype != dtype for p in (*keys, *values)):
        return None  # (float16/bfloat16 pools: the layers' halves around MLX's scatter)
    cos, sin = args.rope.tables(positions, x.dtype)  # (num_tokens, 1, dims // 2) each
    tables, ctx, rows = cpu_ops.step_rows(md)
    h, *pools = module.decoder_stack(
        args.layers, x, cos, sin, md.slot_mapping, tables, ctx, rows, keys, values
    )
    # The cache's entries are replaced before anything evaluates: the op then holds the old
    # pools alone and writes them in place (ops/metal.py says why that matters).
    n = len(layers)
    keys[:], values[:] = pools[:n], pools[n:]
    return h
