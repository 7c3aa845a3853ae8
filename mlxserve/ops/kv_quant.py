"""8-bit K/V pools (``--kv-cache-dtype int8``): one scale per (token, KV head) row.

A quantized pool has dtype int8 and rows of ``head_dim + KV_SCALE_BYTES`` bytes::

    pool (num_blocks, block_size, num_kv_heads, head_dim + 4) int8
    row  | q_0 q_1 ... q_{head_dim-1} | scale (float32, 4 bytes) |
    x_d  ~ q_d * scale,   scale = max_d |x_d| / 127,   q_d = round(x_d / scale) in [-127, 127]

Why one scale per row (per slot and KV head), symmetric:

* Rows are written once, a few at a time (one per decode step), and never rewritten: a
  row's scale depends only on its own values, so an incremental write is exact. A scale per
  block and head would have to be fixed before the block's later tokens exist (clipping
  them) or requantize the block's earlier rows on every write (compounding rounding).
* The scale factors out of the attention dot products: q . (s k^) = s (q . k^) and
  sum_j p_j s_j v^_j = sum_j (p_j s_j) v^_j, so kernels multiply one score and one
  probability per key, not every element (ops/kv_quant is the fallback's definition).
* Symmetric (no zero point): K and V rows are close to zero-centred, so an offset buys
  little at 8 bits (the step is max|x| / 127 instead of (max - min) / 255) and would cost
  4 more bytes per row and an add per element in every kernel.
* float32 scales: the stored scale is the one used to round, so the error bound below
  holds with no rounding of the scale to argue about; 4 bytes per row is 3-6% of a row
  (head_dim 128 / 64).

Error: |x_d - q_d * scale| <= scale / 2 = max|x| / 254 for every element.
The pool's dtype is the format: int8 pools are quantized, float pools are plain.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

from mlxserve.exceptions import ParameterError
from mlxserve.kv_cache_spec import KV_SCALE_BYTES

__all__ = ["KV_SCALE_BYTES", "dequantize", "is_quantized", "kv_pool_dtype", "quantize", "split"]

QUANT_DTYPE = mx.int8
QMAX = 127


def kv_pool_dtype(kv_cache_dtype: str, dtype: mx.Dtype, head_dims: Iterable[int]) -> mx.Dtype:
    """The pools' dtype for the engine's ``kv_cache_dtype`` setting (config.KV_CACHE_DTYPES)
    and activation ``dtype``; ``head_dims`` (every K and V head size) are checked for it."""
    if kv_cache_dtype == "auto":
        return dtype
    assert kv_cache_dtype == "int8", kv_cache_dtype  # config.check_kv_cache_dtype ran
    for dim in head_dims:
        check_head_dim(dim)
    return QUANT_DTYPE


def is_quantized(pool: mx.array) -> bool:
    """Whether ``pool`` holds 8-bit rows with scales (dtype int8)."""
    return pool.dtype == QUANT_DTYPE


def pool_head_dim(pool: mx.array) -> int:
    """The head size a pool's rows hold (its last axis, less the scale if quantized)."""
    return pool.shape[-1] - KV_SCALE_BYTES if is_quantized(pool) else pool.shape[-1]


def pool_row_width(head_dim: int, dtype: mx.Dtype) -> int:
    """Last-axis length of a pool of ``dtype`` holding rows of ``head_dim``."""
    if dtype == QUANT_DTYPE:
        check_head_dim(head_dim)
        return head_dim + KV_SCALE_BYTES
    return head_dim


def check_head_dim(head_dim: int) -> None:
    """Quantized rows keep the float32 scale 4-byte aligned: head sizes multiple of 4."""
    if head_dim % 4:
        raise ParameterError(
            f"kv_cache_dtype int8 needs K/V head sizes that are multiples of 4 (the float32 "
            f"scale after the values stays aligned); this model has {head_dim}: use auto",
            parameter="kv_cache_dtype",
        )


def quantize(
    x: mx.array,  # (..., head_dim) float
) -> mx.array:  # (..., head_dim + KV_SCALE_BYTES) int8
    """Rows of ``x`` as 8-bit values and their float32 scale (absmax / 127)."""
    xf = x.astype(mx.float32)
    scale = mx.abs(xf).max(axis=-1, keepdims=True) / QMAX  # (..., 1)
    safe = mx.where(scale > 0, scale, 1.0)  # an all-zero row stores zeros, scale 0
    q = mx.clip(mx.round(xf / safe), -QMAX, QMAX).astype(QUANT_DTYPE)
    return mx.concatenate([q, scale.view(QUANT_DTYPE)], axis=-1)


def split(
    rows: mx.array,  # (..., head_dim + KV_SCALE_BYTES) int8
) -> tuple[mx.array, mx.array]:  # (..., head_dim) int8, (...,) float32
    """A quantized row's values and scale."""
    scale = mx.contiguous(rows[..., -KV_SCALE_BYTES:]).view(mx.float32)[..., 0]
    return rows[..., :-KV_SCALE_BYTES], scale


def dequantize(
    rows: mx.array,  # (..., head_dim + KV_SCALE_BYTES) int8
    dtype: mx.Dtype,
) -> mx.array:  # (..., head_dim) dtype
    """Values times their row's scale, in ``dtype``."""
    values, scale = split(rows)
    return (values.astype(mx.float32) * scale[..., None]).astype(dtype)
