"""Decoder pieces compiled with ``mx.compile`` for MLX's CPU backend.

On the CPU, MLX runs ``mx.fast.rms_norm`` and ``mx.fast.rope`` as their portable
versions: 11 and ~30 small ops per call, each dispatched on its own (bench/README.md,
"Decode step profile"). Compiled, the elementwise chains become one generated kernel each:
an RMSNorm is 3 ops (square, sum, one fused kernel), a rotation 1, SwiGLU 1. Each function
computes exactly what the op it replaces computes, in the same order (tests compare them
bit for bit with ``mx.fast.rms_norm`` / ``mx.fast.rope`` / ``nn.silu(g) * u``).

On Metal the fast ops are single kernels: callers use them there (see
:func:`mlxserve.utils.uses_gpu`). None of these depend on step metadata, so a compiled
graph is reused for every step of the same number of tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

__all__ = ["rms_norm", "rotate", "swiglu"]


@mx.compile
def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)`` as MLX's portable version computes it."""
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


@mx.compile
def rotate(
    x1: mx.array,  # (num_tokens, num_heads, dims // 2): first of each rotated pair
    x2: mx.array,  # (num_tokens, num_heads, dims // 2): second of each pair
    cos: mx.array,  # (num_tokens, 1, dims // 2)
    sin: mx.array,
) -> tuple[mx.array, mx.array]:
    """RoPE's rotation of the pairs (x1, x2) by the angles whose cos and sin are given."""
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@mx.compile
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``nn.silu(gate) * up``."""
    return nn.silu(gate) * up
