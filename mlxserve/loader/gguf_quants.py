"""GGUF tensor data -> MLX arrays.

MLX's affine format: along each row, every group of 32 values is ``scale * q + bias`` with
``q`` an unsigned ``bits``-bit integer. GGUF types whose 32-value blocks (or sub-blocks)
have exactly that form are repacked bit for bit, keeping their precision and size:

    Q4_0, Q4_1, Q4_K -> 4 bits      Q5_0, Q5_1, Q5_K -> 5 bits      Q8_0 -> 8 bits

MXFP4 (gpt-oss's experts) is MLX's ``mxfp4`` mode exactly: 32 four-bit e2m1 codes and one
E8M0 exponent per block, repacked bit for bit (weight + uint8 scales, no biases).

Every other type (Q6_K, Q2_K, Q3_K: 16-value sub-blocks; IQ*; ...) is dequantized with
the `gguf` package and re-quantized with a min-max affine grid (error at most half a step):
4 bits for types of at most 4 bits per weight, else 8. Or everything is kept float.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QT

from mlxserve.affine_bits import pack_bits

GROUP_SIZE = 32

# Types repacked exactly (MLX bits), and the byte size of one of their blocks.
REPACKABLE = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q5_0: 5, QT.Q5_1: 5, QT.Q8_0: 8, QT.Q4_K: 4, QT.Q5_K: 5}
# Their scale and offset are float16 values exactly (MLX's own GGUF reader agrees) for the
# 32-value types; K-quant sub-block scales are f16 x 6-bit products: kept float32.
FLOAT16_SCALES = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0}
FLOAT_TYPES = {QT.F32, QT.F16, QT.BF16}
# MLX quantization settings of a repacked MXFP4 tensor (mx.quantize(..., mode="mxfp4")).
MXFP4_MODE = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def _f16(b: np.ndarray) -> np.ndarray:  # (n, 2) bytes -> (n,) float32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32): element j is qs[j] & 15, element j+16 is qs[j] >> 4."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes, a little-endian uint32 -> (n, 32): bit j is element j's 5th bit."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")  # (n, 32)
    return bits << 4


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes per block -> 8 (scale, min) 6-bit pairs, each (n, 8).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def decode_blocks(
    raw: np.ndarray, qtype: QT
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # (groups, 32) uint8, (groups,), (groups,)
    """Blocks of a repackable type -> per 32-value group: q, scale, bias (w = scale*q + bias)."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)  # one row per block
    if qtype in (QT.Q4_0, QT.Q8_0, QT.Q5_0):
        d = _f16(blocks[:, 0:2])
        if qtype == QT.Q4_0:
            return _nibbles(blocks[:, 2:]), d, -8.0 * d
        if qtype == QT.Q8_0:
            q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return q, d, -128.0 * d
        return _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6]), d, -16.0 * d
    if qtype in (QT.Q4_1, QT.Q5_1):
        d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        if qtype == QT.Q4_1:
            return _nibbles(blocks[:, 4:]), d, m
        return _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8]), d, m
    # Q4_K / Q5_K: 256 values in 8 sub-blocks of 32, w = d*sc*q - dmin*m per sub-block.
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    n = len(blocks)
    qs = blocks[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32)  # sub-block 2k: low nibbles of bytes 32k.., 2k+1: high
    if qtype == QT.Q5_K:
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)  # sub-block j's 5th bits are bit j of qh[0..31]
    scale = (d[:, None] * sc).reshape(-1)
    bias = -(dmin[:, None] * mn).reshape(-1)
    return q.reshape(-1, 32), scale, bias


def _mlx_parts(
    q: np.ndarray, scale: np.ndarray, bias: np.ndarray, rows: int, cols: int, bits: int, dtype
) -> dict[str, mx.array]:
    groups = cols // GROUP_SIZE
    return {
        "weight": mx.array(pack_bits(q.reshape(rows, cols), bits)),
        "scales": mx.array(scale.reshape(rows, groups).astype(dtype)),
        "biases": mx.array(bias.reshape(rows, groups).astype(dtype)),
    }


def repack_blocks(raw: np.ndarray, qtype: QT, rows: int, cols: int) -> dict[str, mx.array]:
    """Raw blocks of a repackable type, a (rows, cols) matrix -> {weight, scales, biases}."""
    if qtype not in REPACKABLE:
        raise ValueError(f"cannot repack GGUF type {qtype.name}")
    q, scale, bias = decode_blocks(raw, qtype)
    dtype = np.float16 if qtype in FLOAT16_SCALES else np.float32
    return _mlx_parts(q, scale, bias, rows, cols, REPACKABLE[qtype], dtype)


def repack_mxfp4(raw: np.ndarray, rows: int, cols: int) -> dict[str, mx.array]:
    """MXFP4 blocks of a (rows, cols) matrix -> MLX mxfp4 {weight, scales}.

    A GGUF block is one E8M0 exponent byte and 16 bytes of e2m1 codes (byte j: element j
    low, element j + 16 high); llama.cpp's value is its doubled e2m1 table times half the
    exponent's power of two, which is MLX's e2m1 value times the whole power: the same
    codes and exponents, only the nibble order differs.
    """
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 17)  # one row per block
    q = _nibbles(blocks[:, 1:])  # (blocks, 32) e2m1 codes in element order
    return {
        "weight": mx.array(pack_bits(q.reshape(rows, cols), 4)),
        "scales": mx.array(np.ascontiguousarray(blocks[:, 0]).reshape(rows, cols // 32)),
    }


def affine_quantize(dense: np.ndarray, bits: int) -> dict[str, mx.array]:
    """Min-max affine quantization of a (rows, cols) float matrix, groups of 32.

    Each group's grid runs from its minimum to its maximum, so every value is within half
    a step of a grid point (a grid of 2**bits levels that GGUF's own values lie on exactly,
    as in a repacked block, is reproduced exactly).
    """
    rows, cols = dense.shape
    g = dense.reshape(-1, GROUP_SIZE)
    lo, hi = g.min(axis=1), g.max(axis=1)
    scale = (hi - lo) / (2**bits - 1)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint((g - lo[:, None]) / safe[:, None]), 0, 2**bits - 1)
    return _mlx_parts(q.astype(np.uint8), scale, lo, rows, cols, bits, np.float32)


def requantize_bits(qtype: QT) -> int:
    """MLX bits that keep at least the precision of a GGUF type (4 for <= 4-bit types)."""
    name = qtype.name
    low = ("Q2", "Q3", "Q4", "IQ1", "IQ2", "IQ3", "IQ4", "TQ", "MXFP4", "NVFP4")
    return 4 if name.startswith(low) else 8


def convert_tensor(
    raw: np.ndarray, qtype: QT, shape: tuple[int, ...], keep_float: bool
) -> dict[str, mx.array]:
    """One GGUF tensor -> {"weight": ...} (+ "scales"/"biases" when quantized).

    ``shape`` is numpy order: (rows, cols), or (experts, rows, cols) for stacked MoE experts.
    Float tensors stay as stored; quantized ones are repacked or re-quantized (see the
    module docstring), or with ``keep_float`` dequantized to float32.
    """
    if qtype in FLOAT_TYPES:
        data = np.ascontiguousarray(raw).view(np.uint8)  # raw bytes or an already typed array
        if qtype == QT.BF16:  # numpy has no bfloat16: widen the raw 16-bit words
            arr = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            return {"weight": mx.array(arr.reshape(shape)).astype(mx.bfloat16)}
        arr = data.view(np.float32 if qtype == QT.F32 else np.float16)
        return {"weight": mx.array(arr.reshape(shape))}
    quantizable = len(shape) in (2, 3) and shape[-1] % GROUP_SIZE == 0
    rows, cols = int(np.prod(shape[:-1])), shape[-1]  # stacked experts: one matrix of rows
    if quantizable and not keep_float and (qtype in REPACKABLE or qtype == QT.MXFP4):
        if qtype == QT.MXFP4:
            parts = repack_mxfp4(raw, rows, cols)
        else:
            parts = repack_blocks(raw, qtype, rows, cols)
        return {k: v.reshape(*shape[:-1], v.shape[-1]) for k, v in parts.items()}
    try:
        dense = quants.dequantize(raw, qtype).reshape(shape).astype(np.float32)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}") from None
    if keep_float or not quantizable:
        return {"weight": mx.array(dense)}
    parts = affine_quantize(dense.reshape(rows, cols), requantize_bits(qtype))
    return {k: v.reshape(*shape[:-1], v.shape[-1]) for k, v in parts.items()}
