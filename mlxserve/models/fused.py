"""Fused projections: one matmul for q/k/v and one for gate/up, made from the loaded layers.

A decode step is dominated by per-op costs on small inputs (graph building in Python,
MLX's dispatch, the matmul kernels' per-call setup), so the llama-family decoders run::

    x -> qkv_proj  (rows: q | k | v)      -> split -> q, k, v
    h -> gate_up_proj (rows: gate | up)   -> split -> silu(gate) * up

The fused layer is the same class as the layers it replaces (nn.Linear,
nn.QuantizedLinear, mlxserve's CpuQuantizedLinear) with every parameter concatenated along
the output rows, so row n of the product is computed exactly as before. Quantized layers
of different widths are fused at the widest (a 5-bit value is the same value in 8 bits,
with the same scale and bias), 16- and 32-bit scales at float32: GGUF K-quant mixes store
q/k/v in different types (Q5_0 q and k, a Q8_0 v on some layers), and a layer that cannot
fuse leaves the whole CPU stack (mlxserve/cpu/stack.py). Layers that differ otherwise
(class, group size, mode, bias or not) stay separate.

Fusion runs after loading and after tensor-parallel sharding (shards are row slices of
q/k/v and gate/up: each rank fuses its own slices), whatever the checkpoint format; a
pipeline stage's layers are fused on their rank.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxserve.affine_bits import pack_bits, unpack_bits

__all__ = ["fuse_linears", "fuse_projections"]

_SETTINGS = ("group_size", "mode")


def _common_format(layers: list[nn.Module]) -> tuple[int | None, mx.Dtype | None] | None:
    """(bits, scales dtype) the layers can all be stored in exactly (None, None for float
    layers), or None when they cannot be fused."""
    first = layers[0]
    if not isinstance(first, (nn.Linear, nn.QuantizedLinear)):
        return None
    keys = sorted(first.keys())
    for layer in layers:
        if type(layer) is not type(first) or sorted(layer.keys()) != keys:
            return None
        if any(getattr(layer, s, None) != getattr(first, s, None) for s in _SETTINGS):
            return None
    if not isinstance(first, nn.QuantizedLinear):
        return (None, None) if _same_arrays(layers, keys) else None
    if getattr(first, "mode", "affine") != "affine" or "biases" not in first:  # (mxfp4: as is)
        same_bits = all(layer.bits == first.bits for layer in layers)
        return (first.bits, None) if same_bits and _same_arrays(layers, keys) else None
    others = [k for k in keys if k not in ("weight", "scales", "biases")]  # (a bias)
    if not _same_arrays(layers, others):
        return None
    bits = max(layer.bits for layer in layers)
    dtypes = {layer[k].dtype for layer in layers for k in ("scales", "biases")}
    return bits, dtypes.pop() if len(dtypes) == 1 else mx.float32


def _same_arrays(layers: list[nn.Module], keys: list[str]) -> bool:
    first = layers[0]
    for layer in layers:
        for k in keys:
            a, b = first[k], layer[k]
            if not isinstance(b, mx.array) or b.dtype != a.dtype or b.shape[1:] != a.shape[1:]:
                return False
    return True


def _stored_as(layer: nn.Module, bits: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    """An affine layer's arrays with its values packed at ``bits`` (>= its own) and its
    scales and biases in ``dtype``: the same dequantized weights, exactly."""
    arrays = dict(layer.items())
    if layer.bits != bits:
        q = unpack_bits(np.array(layer["weight"]), layer.bits)  # (rows, cols) uint8
        arrays["weight"] = mx.array(pack_bits(q, bits))
    for k in ("scales", "biases"):
        arrays[k] = arrays[k].astype(dtype)
    return arrays


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is the layers' outputs side by side; None if they differ."""
    common = _common_format(layers) if len(layers) >= 2 else None
    if common is None:
        return None
    bits, dtype = common
    first = layers[0]
    parts = [dict(layer.items()) for layer in layers]
    if bits is not None and dtype is not None and "biases" in first:
        parts = [_stored_as(layer, bits, dtype) for layer in layers]
    fused = type(first).__new__(type(first))  # same class and settings, new parameters
    dict.update(fused, first)  # (nn.Module is a dict of its parameters)
    fused.__dict__.update(first.__dict__)
    if bits is not None:
        fused.bits = bits
    for k in first.keys():
        fused[k] = mx.concatenate([part[k] for part in parts], axis=0)
    return fused


def _out_rows(layer: nn.Module) -> int:
    return layer["weight"].shape[0]


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every llama-family layer of ``model`` (in place).

    Returns how many fused layers were made; idempotent; models of other families are
    left alone.
    """
    stack = getattr(model, "model", model)  # (a pipeline stage holds its layers itself)
    count = 0
    for layer in getattr(stack, "layers", None) or []:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if hasattr(attn, "fuse_qkv") and "q_proj" in attn:
            parts = [attn.q_proj, attn.k_proj, attn.v_proj]
            fused = fuse_linears(parts)
            if fused is not None:
                attn.fuse_qkv(fused, [_out_rows(p) for p in parts])
                count += 1
        if hasattr(mlp, "fuse_gate_up") and "gate_proj" in mlp:
            same_rows = _out_rows(mlp.gate_proj) == _out_rows(mlp.up_proj)
            fused = fuse_linears([mlp.gate_proj, mlp.up_proj]) if same_rows else None
            if fused is not None:
                mlp.fuse_gate_up(fused)
                count += 1
        mx.eval(layer.parameters())  # one layer at a time: the unfused copies go now
    return count
