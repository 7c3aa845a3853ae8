"""MLX's packing of affine-quantized values into uint32 words, both ways (numpy).

MLX packs each row as a little-endian bit stream: value i of a row sits at bits
[i * bits, (i + 1) * bits) of the row's words (mx.quantize, nn.QuantizedLinear).
"""

from __future__ import annotations

import numpy as np


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) values < 2**bits -> (rows, cols * bits / 32) uint32."""
    rows, cols = q.shape
    q = q.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view(np.uint32)
    # 8 values = `bits` bytes: combine them in a uint64, keep its low `bits` bytes.
    v = q.reshape(rows, cols // 8, 8).astype(np.uint64)
    v = (v << (np.arange(8, dtype=np.uint64) * np.uint64(bits))).sum(-1, dtype=np.uint64)
    packed = v[..., None].view(np.uint8)[..., :bits]  # (rows, cols / 8, bits)
    return np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """(rows, words) uint32 -> (rows, words * 32 / bits) uint8: the inverse of pack_bits."""
    rows = packed.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=1, bitorder="little")
    values = stream.reshape(rows, -1, bits)  # (rows, cols, bits): each value's bits, low first
    return np.packbits(values, axis=-1, bitorder="little")[..., 0]


def widen(weight: np.ndarray, bits: int, new_bits: int) -> np.ndarray:
    """Packed ``bits``-bit values repacked at ``new_bits`` (>= bits): the same values."""
    return pack_bits(unpack_bits(weight, bits), new_bits)
