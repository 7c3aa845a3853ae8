"""A llama-family decoder layer in one op on MLX's CPU backend (csrc/layer_ext.cpp).

Each op MLX evaluates costs ~11 us of dispatch here, on top of its (small) work, and a
layer used to be ~19 of them, then 5. With mlxserve's CPU primitives loaded, every linear
layer on the quantized matmul kernels and float32 or int8 K/V pools, a layer is one op::

    x, k_pool, v_pool -> decoder_layer -> h, k_pool, v_pool
        attention_input: RMSNorm, q|k|v projection (+ bias), [q/k norms,] split + RoPE
        k and v written into their slots (int8 pools: quantized), in place when the old
        pools can be donated; the paged attention of cpu/ops.py
        output_mlp: o_proj, + x, RMSNorm, gate|up projection, SwiGLU, down, + h

Where every layer of a model is such a layer, cpu/stack.py makes all of them one op (the
same function per layer, in order). cpu/install.py binds these onto a loaded model's
layers (they never look at which backend they run on).

Where the whole layer does not apply but its dense halves do (another attention: the
Metal kernels, an mlx-lm layer's), ``attention_input`` and ``output_mlp`` are one op each
around the separate K/V write and attention (5 ops). A quantized embedding's lookup is one
op too (``embed``).

Each primitive runs the same kernels in the same order as the separate ops (the same
bits, tests/test_cpu_layer.py). Where a part does not apply (other backends, the pure-MLX
fallback forced, layers not on the kernels, unfused projections, tensor-parallel shards,
activations other than float32) these return None and the layer builds the separate
ops' graph.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve import ops
from mlxserve.cpu import ops as cpu_ops
from mlxserve.cpu.kernels import CpuQuantizedEmbedding, CpuQuantizedLinear
from mlxserve.models import llama
from mlxserve.ops import AttentionMetadata

__all__ = [
    "attends_as_llama",
    "attention_input",
    "decoder_layer",
    "embed",
    "linear_args",
    "output_mlp",
]


def attends_as_llama(layer: nn.Module) -> bool:
    """Whether ``layer`` is a llama-family decoder layer whose attention is
    llama.Attention's own (a subclass may attend its own way: then the fused layer, which
    attends inside, does not apply)."""
    return isinstance(layer, llama.DecoderLayer) and (
        type(layer.self_attn).attend is llama.Attention.attend
    )


def linear_args(layer: Any) -> tuple[list[mx.array], list[int]] | None:
    """A kernel layer's arrays (w, scales, biases[, bias]) and settings; None otherwise."""
    if type(layer) is not CpuQuantizedLinear:  # (subclasses: sharded layers, wrappers)
        return None
    arrays = [layer["weight"], layer["scales"], layer["biases"]]
    if "bias" in layer:
        arrays.append(layer["bias"])
    return arrays, [layer.group_size, layer.bits, layer.act_bits]


def _attention_input_args(
    attn: nn.Module,  # models.llama.Attention
    norm: nn.Module,  # its input RMSNorm
    x: mx.array,  # (num_tokens, hidden)
    positions: mx.array,  # (num_tokens,) int32
) -> tuple[ModuleType, dict[str, Any]] | None:
    """The CPU module and attention_input's keyword arguments (shared by decoder_layer), or
    None where the fused half does not apply."""
    if x.dtype != mx.float32 or "qkv_proj" not in attn:
        return None
    qkv = linear_args(attn.qkv_proj)
    module = ops.cpu_module() if qkv is not None else None
    if module is None:
        return None
    qk_norms, qk_eps = [], 0.0
    if "q_norm" in attn:  # qwen3: each head of q and k normed before RoPE
        qk_norms, qk_eps = [attn.q_norm["weight"], attn.k_norm["weight"]], attn.q_norm.eps
        if attn.k_norm.eps != qk_eps:
            return None
    cos, sin = attn.rope.tables(positions, x.dtype)  # once per step, shared by the layers
    return module, {
        "x": x, "norm_weight": norm["weight"], "eps": norm.eps, "qkv": qkv[0],
        "qkv_settings": qkv[1], "cos": cos, "sin": sin, "traditional": attn.rope.traditional,
        "qk_norms": qk_norms, "qk_eps": qk_eps,
    }  # fmt: skip


def attention_input(
    attn: nn.Module,  # models.llama.Attention
    norm: nn.Module,  # its input RMSNorm
    x: mx.array,  # (num_tokens, hidden)
    positions: mx.array,  # (num_tokens,) int32
) -> list[mx.array] | None:  # q (num_tokens, num_heads, head_dim), k, v (see below)
    """q, k, v of the layer's attention in one op, or None where that does not apply.

    k and v come out as (num_tokens, 1, 1, num_kv_heads, head_dim): the update shape of the
    K/V write's scatter (ops.write_kv on the CPU), so the writes need no Reshape ops.
    """
    found = _attention_input_args(attn, norm, x, positions)
    if found is None:
        return None
    module, args = found
    heads = [attn.num_heads, attn.num_kv_heads, attn.num_kv_heads]
    return module.attention_input(
        **args, heads=heads, head_dims=[attn.head_dim] * 3, rotated=2, kv_rows=True
    )


def _output_mlp_args(
    layer: nn.Module,  # models.llama.DecoderLayer
) -> dict[str, Any] | None:
    """output_mlp's weights and settings as keyword arguments, or None where it does not
    apply (a linear layer not on the kernels, unfused gate/up projections)."""
    mlp = layer.mlp
    if "gate_up_proj" not in mlp:
        return None
    parts = [linear_args(m) for m in (layer.self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if None in parts:
        return None
    (o, o_set), (gate_up, gate_up_set), (down, down_set) = parts
    norm = layer.post_attention_layernorm
    return {
        "o": o, "o_settings": o_set, "norm_weight": norm["weight"], "eps": norm.eps,
        "gate_up": gate_up, "gate_up_settings": gate_up_set, "down": down,
        "down_settings": down_set,
    }  # fmt: skip


def output_mlp(
    layer: nn.Module,  # models.llama.DecoderLayer
    x: mx.array,  # (num_tokens, hidden): the layer's input
    attn_out: mx.array,  # (num_tokens, num_heads, head_dim): the attention's output
) -> mx.array | None:  # (num_tokens, hidden): the layer's output
    """The rest of the layer in one op, or None where that does not apply."""
    if x.dtype != mx.float32 or attn_out.dtype != mx.float32:
        return None
    args = _output_mlp_args(layer)
    module = ops.cpu_module() if args is not None else None
    if module is None:
        return None
    return module.output_mlp(x, attn_out, **args)


def decoder_layer(
    layer: nn.Module,  # models.llama.DecoderLayer
    x: mx.array,  # (num_tokens, hidden)
    positions: mx.array,  # (num_tokens,) int32
    md: AttentionMetadata,
    cache: Any,  # models.base.KVCache: the layer's pools are replaced by the written ones
) -> mx.array | None:  # (num_tokens, hidden): the layer's output
    """The whole layer in one op (the K/V write and the attention inside), or None where
    that does not apply: then the layer runs its halves around ops.write_kv and
    ops.paged_attention."""
    attn = layer.self_attn
    found = _attention_input_args(attn, layer.input_layernorm, x, positions)
    mlp_args = _output_mlp_args(layer) if found is not None else None
    if mlp_args is None:
        return None
    i = attn.layer_idx
    k_pool, v_pool = cache.keys[i], cache.values[i]
    if k_pool.dtype not in (mx.float32, mx.int8) or v_pool.dtype != k_pool.dtype:
        return None  # (float16/bfloat16 pools: the halves, and MLX's scatter casts the rows)
    if md.slot_mapping.dtype != mx.int32:
        return None
    module, in_args = found
    tables, ctx, rows = cpu_ops.step_rows(md)
    post = {"post_norm_weight": mlp_args.pop("norm_weight"), "post_eps": mlp_args.pop("eps")}
    # The cache's entries are replaced before anything evaluates: the op then holds the old
    # pools alone and writes them in place (ops/metal.py says why that matters).
    h, cache.keys[i], cache.values[i] = module.decoder_layer(
        **in_args, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, k_pool=k_pool, v_pool=v_pool, slot_mapping=md.slot_mapping,
        block_tables=tables, context_lens=ctx, num_rows=rows, scale=attn.scale, **mlp_args,
        **post,
    )  # fmt: skip
    return h


def embed(
    embedding: nn.Module,  # the stack's embed_tokens
    input_ids: mx.array,  # (num_tokens,) int32
) -> mx.array | None:  # (num_tokens, hidden) float32
    """A quantized embedding's lookup in one op (MLX's portable dequantize of the gathered
    rows is ~30), or None where that does not apply."""
    if type(embedding) is not CpuQuantizedEmbedding or embedding.out_dtype != mx.float32:
        return None
    module = ops.cpu_module() if input_ids.dtype == mx.int32 else None
    if module is None:
        return None
    return module.embed_rows(
        input_ids,
        embedding["weight"],
        embedding["scales"],
        embedding["biases"],
        embedding.group_size,
        embedding.bits,
    )
