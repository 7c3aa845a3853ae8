"""A llama-family decoder layer in 5 ops on MLX's CPU backend (csrc/layer_ext.cpp).

Each op MLX evaluates costs ~11 us of dispatch here, on top of its (small) work, and a
layer used to be ~19 of them. With mlxserve's CPU primitives loaded and every linear layer
on the quantized matmul kernels, a layer runs::

    x -> attention_input: RMSNorm, q|k|v projection (+ bias), [q/k norms,] split + RoPE
         write_kv: 2 x MLX's scatter (the pools stay updated in place); paged attention
    x, attn -> output_mlp: o_proj, + x, RMSNorm, gate|up projection, SwiGLU, down, + h

and a quantized embedding's lookup is one op too (``embed``).

Each primitive runs the same kernels in the same order as the separate ops (the same
bits, tests/test_cpu_layer.py). Where a half does not apply (other backends, the pure-MLX
fallback forced, layers not on the kernels, unfused projections, tensor-parallel shards,
activations other than float32) these return None and the layer builds today's
graph.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve import ops
from mlxserve.cpu import CpuQuantizedEmbedding, CpuQuantizedLinear

__all__ = ["attention_input", "embed", "output_mlp"]


def _linear(layer: Any) -> tuple[list[mx.array], list[int]] | None:
    """A kernel layer's arrays (w, scales, biases[, bias]) and settings; None otherwise."""
    if type(layer) is not CpuQuantizedLinear:  # (subclasses: sharded layers, wrappers)
        return None
    arrays = [layer["weight"], layer["scales"], layer["biases"]]
    if "bias" in layer:
        arrays.append(layer["bias"])
    return arrays, [layer.group_size, layer.bits, layer.act_bits]


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
    if x.dtype != mx.float32 or "qkv_proj" not in attn:
        return None
    qkv = _linear(attn.qkv_proj)
    module = ops.cpu_module() if qkv is not None else None
    if module is None:
        return None
    heads = [attn.num_heads, attn.num_kv_heads, attn.num_kv_heads]
    qk_norms, qk_eps = [], 0.0
    if "q_norm" in attn:  # qwen3: each head of q and k normed before RoPE
        qk_norms, qk_eps = [attn.q_norm["weight"], attn.k_norm["weight"]], attn.q_norm.eps
        if attn.k_norm.eps != qk_eps:
            return None
    cos, sin = attn.rope.tables(positions, x.dtype)  # once per step, shared by the layers
    return module.attention_input(
        x, norm["weight"], norm.eps, *qkv, cos, sin, heads, [attn.head_dim] * 3, 2,
        attn.rope.traditional, kv_rows=True, qk_norms=qk_norms, qk_eps=qk_eps,
    )  # fmt: skip


def output_mlp(
    layer: nn.Module,  # models.llama.DecoderLayer
    x: mx.array,  # (num_tokens, hidden): the layer's input
    attn_out: mx.array,  # (num_tokens, num_heads, head_dim): the attention's output
) -> mx.array | None:  # (num_tokens, hidden): the layer's output
    """The rest of the layer in one op, or None where that does not apply."""
    mlp = layer.mlp
    if x.dtype != mx.float32 or attn_out.dtype != mx.float32 or "gate_up_proj" not in mlp:
        return None
    parts = [_linear(layer.self_attn.o_proj), _linear(mlp.gate_up_proj), _linear(mlp.down_proj)]
    module = ops.cpu_module() if None not in parts else None
    if module is None:
        return None
    (o, o_set), (gate_up, gate_up_set), (down, down_set) = parts
    norm = layer.post_attention_layernorm
    return module.output_mlp(
        x, attn_out, o, o_set, norm["weight"], norm.eps, gate_up, gate_up_set, down, down_set
    )


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
