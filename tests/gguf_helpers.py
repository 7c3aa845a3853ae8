"""Tiny GGUF files written the way llama.cpp's converter writes them, for loader tests.

Tensor names come from the gguf package's own HF -> GGUF name map, llama Q/K rows are
permuted as llama.cpp's converter permutes them, and quantized blocks are either made by
``gguf.quants.quantize`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or by the small numpy K-quant
quantizers below (Q4_K, Q6_K: the gguf package can read but not write those). What a
reader should get back is ``gguf.quants.dequantize`` of the exact bytes written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

QK_K = 256  # K-quant super-block size


def llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to llama Q and K weights."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llamacpp_unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`llamacpp_permute`, by inverting its row index map."""
    order = llamacpp_permute(np.arange(w.shape[0]), num_heads)  # permuted[i] = w[order[i]]
    out = np.empty_like(w)
    out[order] = w
    return out


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:  # (rows, cols / 256 * 144) uint8
    """Q4_K blocks: 8 sub-blocks of 32, y = d*sc*q - dmin*m, 6-bit sc/m, 4-bit q.

    Block bytes: d (f16), dmin (f16), 12 bytes of packed 6-bit (sc, m), 128 bytes of q
    (byte 32k+l holds sub-block 2k's element l low, sub-block 2k+1's high).
    """
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # (blocks, sub-blocks, 32)
    lo = np.minimum(x.min(-1), 0.0)  # (blocks, 8): offsets are never positive
    step = (x.max(-1) - lo) / 15
    d = _f16(np.maximum(step.max(-1), 1e-8) / 63)  # (blocks,)
    dmin = _f16(np.maximum((-lo).max(-1), 1e-8) / 63)
    sc = np.clip(np.round(step / d[:, None]), 1, 63).astype(np.uint8)  # (blocks, 8)
    m = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    scale = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * m)[..., None]
    q = np.clip(np.round((x + offset) / scale), 0, 15).astype(np.uint8)  # (blocks, 8, 32)
    packed = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=1,
    )  # (blocks, 12)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # (blocks, 128)
    blocks = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
            packed,
            qs,
        ],
        axis=1,
    )
    return blocks.reshape(rows, cols // QK_K * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:  # (rows, cols / 256 * 210) uint8
    """Q6_K blocks: 16 sub-blocks of 16, y = d*sc*(q - 32), int8 sc, 6-bit q.

    Block bytes: ql (128: low 4 bits), qh (64: high 2 bits), sc (16 int8), d (f16).
    In each 128-element half, ql[l] holds elements l (low) and l+64 (high nibble),
    ql[l+32] holds l+32 and l+96, and qh[l] the high bits of l, l+32, l+64, l+96.
    """
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)  # (blocks, sub-blocks, 16)
    step = np.abs(x).max(-1) / 31  # (blocks, 16)
    d = _f16(np.maximum(step.max(-1), 1e-8) / 127)  # (blocks,)
    sc = np.clip(np.round(step / d[:, None]), 1, 127).astype(np.int8)
    scale = (d[:, None] * sc)[..., None]
    q = (np.clip(np.round(x / scale), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    e = [q[:, :, 32 * j : 32 * (j + 1)] for j in range(4)]  # (blocks, 2, 32) each
    ql = np.concatenate([(e[0] & 15) | ((e[2] & 15) << 4), (e[1] & 15) | ((e[3] & 15) << 4)], -1)
    qh = (e[0] >> 4) | ((e[1] >> 4) << 2) | ((e[2] >> 4) << 4) | ((e[3] >> 4) << 6)
    blocks = np.concatenate(
        [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            sc.view(np.uint8),
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return blocks.reshape(rows, cols // QK_K * 210)


def encode_tensor(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or float array to write, what gguf's dequantizer reads back as float32)."""
    if qtype == QT.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == QT.F16:
        return w.astype(np.float16), _f16(w)
    if qtype == QT.Q4_K:
        raw = quantize_q4_k(w)
    elif qtype == QT.Q6_K:
        raw = quantize_q6_k(w)
    else:
        raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape)


def close_gguf(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors, then close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, np.ndarray],
    qtypes: dict[str, QT] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    metadata: dict[str, Any] | None = None,
    write_vocab_size: bool = False,
) -> dict[str, np.ndarray]:
    """Write HF-named float weights of a llama/qwen2/qwen3 ``config`` as a GGUF file.

    ``qtypes[hf_name]`` picks a tensor's type (default F32). Returns the float weights a
    correct reader must produce (HF names, HF row order): gguf's dequantization of the bytes.
    """
    arch = config["model_type"]
    num_layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if write_vocab_size:
        writer.add_vocab_size(config["vocab_size"])
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    qtypes = qtypes or {}
    expected = {}
    for hf_name, w in weights.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        permute_heads = None
        if arch == "llama" and ".q_proj." in hf_name:
            permute_heads = heads
        elif arch == "llama" and ".k_proj." in hf_name:
            permute_heads = kv_heads
        stored = w if permute_heads is None else llamacpp_permute(w, permute_heads)
        raw, readback = encode_tensor(stored, qtypes.get(hf_name, QT.F32))
        if raw.dtype == np.uint8:
            writer.add_tensor(gguf_name, raw, raw_dtype=qtypes[hf_name])
        else:
            writer.add_tensor(gguf_name, raw)
        expected[hf_name] = (
            readback if permute_heads is None else llamacpp_unpermute(readback, permute_heads)
        )
    for name, arr in (extra_tensors or {}).items():
        writer.add_tensor(name, arr)
    close_gguf(writer)
    return expected
