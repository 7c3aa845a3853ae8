"""GGUF tensor data -> MLX arrays.

Q4_0, Q4_1 and Q8_0 are affine quantizations with groups of 32, which is exactly MLX's
quantized format, so their blocks are repacked bit for bit. Every other type is
dequantized with the `gguf` package and re-quantized with ``mx.quantize`` (or kept float).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

GROUP_SIZE = 32

# Types whose blocks map one-to-one onto MLX's affine format (bits per weight).
REPACKABLE = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q8_0: 8}
FLOAT_TYPES = {QT.F32, QT.F16, QT.BF16}


def _unpack_q4(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) nibbles; element j is qs[j] & 15, element j+16 is qs[j] >> 4."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) integer values -> (rows, cols * bits / 32) uint32, MLX's packing."""
    rows, cols = q.shape
    q = q.astype(np.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # two nibbles per byte, low first
    return np.ascontiguousarray(q).view(np.uint32).reshape(rows, cols * bits // 32)


def repack_blocks(raw: np.ndarray, qtype: QT, rows: int, cols: int) -> dict[str, mx.array]:
    """Raw Q4_0/Q4_1/Q8_0 bytes of a (rows, cols) matrix -> {weight, scales, biases}."""
    groups = cols // GROUP_SIZE
    blocks = np.ascontiguousarray(raw).reshape(rows * groups, -1)  # one row per block
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    if qtype == QT.Q4_1:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = _unpack_q4(blocks[:, 4:])
        bias = m
    elif qtype == QT.Q4_0:
        q = _unpack_q4(blocks[:, 2:])
        bias = -8.0 * d
    elif qtype == QT.Q8_0:
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = -128.0 * d
    else:
        raise ValueError(f"cannot repack GGUF type {qtype.name}")
    bits = REPACKABLE[qtype]
    weight = _pack_bits(q.reshape(rows, cols), bits)
    return {
        "weight": mx.array(weight),
        "scales": mx.array(d.reshape(rows, groups).astype(np.float16)),
        "biases": mx.array(bias.reshape(rows, groups).astype(np.float16)),
    }


def requantize_bits(qtype: QT) -> int:
    """MLX bits that keep at least the precision of a GGUF type (4 for <= 4-bit types)."""
    name = qtype.name
    low = ("Q2", "Q3", "Q4", "IQ1", "IQ2", "IQ3", "IQ4", "TQ", "MXFP4", "NVFP4")
    return 4 if name.startswith(low) else 8


def convert_tensor(
    raw: np.ndarray, qtype: QT, shape: tuple[int, ...], keep_float: bool
) -> dict[str, mx.array]:
    """One GGUF tensor -> {"weight": ...} (+ "scales"/"biases" when quantized).

    ``shape`` is numpy order (rows, cols). Float tensors stay float; repackable types
    stay quantized; other types are dequantized, then re-quantized unless ``keep_float``.
    """
    if qtype in FLOAT_TYPES:
        if qtype == QT.BF16:  # numpy has no bfloat16: widen the raw 16-bit words
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            return {"weight": mx.array(arr.reshape(shape)).astype(mx.bfloat16)}
        return {"weight": mx.array(np.ascontiguousarray(raw).reshape(shape))}
    quantizable = len(shape) == 2 and shape[1] % GROUP_SIZE == 0
    if qtype in REPACKABLE and quantizable and not keep_float:
        return repack_blocks(raw, qtype, shape[0], shape[1])
    try:
        dense = quants.dequantize(raw, qtype).reshape(shape).astype(np.float32)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}") from None
    if keep_float or not quantizable:
        return {"weight": mx.array(dense).astype(mx.float16)}
    w, scales, biases = mx.quantize(
        mx.array(dense), group_size=GROUP_SIZE, bits=requantize_bits(qtype)
    )
    return {"weight": w, "scales": scales.astype(mx.float16), "biases": biases.astype(mx.float16)}
