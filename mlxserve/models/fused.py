"""Fused projections: one matmul for q/k/v and one for gate/up, made from the loaded layers.

A decode step is dominated by per-op costs on small inputs (graph building in Python,
MLX's dispatch, the matmul kernels' per-call setup), so the llama-family decoders run::

    x -> qkv_proj  (rows: q | k | v)      -> split -> q, k, v
    h -> gate_up_proj (rows: gate | up)   -> split -> silu(gate) * up

The fused layer is the same class as the layers it replaces (nn.Linear,
nn.QuantizedLinear, mlxserve's CpuQuantizedLinear) with every parameter concatenated along
the output rows, so row n of the product is computed exactly as before. Layers that
differ (class, bits, group size, dtypes, bias or not) stay separate.

Fusion runs after loading and after tensor-parallel sharding (shards are row slices of
q/k/v and gate/up: each rank fuses its own slices), whatever the checkpoint format.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

__all__ = ["fuse_linears", "fuse_projections"]

_SETTINGS = ("group_size", "bits", "mode")


def _compatible(layers: list[nn.Module]) -> bool:
    first = layers[0]
    if not isinstance(first, (nn.Linear, nn.QuantizedLinear)):
        return False
    keys = sorted(first.keys())
    for layer in layers:
        if type(layer) is not type(first) or sorted(layer.keys()) != keys:
            return False
        if any(getattr(layer, s, None) != getattr(first, s, None) for s in _SETTINGS):
            return False
        for k in keys:
            a, b = first[k], layer[k]
            if not isinstance(b, mx.array) or b.dtype != a.dtype or b.shape[1:] != a.shape[1:]:
                return False
    return True


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is the layers' outputs side by side; None if they differ."""
    if len(layers) < 2 or not _compatible(layers):
        return None
    first = layers[0]
    fused = type(first).__new__(type(first))  # same class and settings, new parameters
    dict.update(fused, first)  # (nn.Module is a dict of its parameters)
    fused.__dict__.update(first.__dict__)
    for k in first.keys():
        fused[k] = mx.concatenate([layer[k] for layer in layers], axis=0)
    return fused


def _out_rows(layer: nn.Module) -> int:
    return layer["weight"].shape[0]


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every llama-family layer of ``model`` (in place).

    Returns how many fused layers were made; idempotent; models of other families are
    left alone.
    """
    stack = getattr(model, "model", None)
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
