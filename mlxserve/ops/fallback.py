"""Pure-MLX attention over the block pool: runs everywhere, and defines what is correct.

The Metal kernels are tested against these functions; these are tested against a
plainly written dense attention (tests/test_paged_attention.py).

Per-layer variants (as mlx-lm's layers compute them):

* ``window``: sliding-window attention; a query at position p sees keys in (p - window, p].
  Only the blocks that hold such keys are gathered.
* ``sinks``: one learned logit per query head (gpt-oss) that joins the softmax denominator
  and attends to nothing: ``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink))``.
* K and V may have different head sizes (MLA-style layers); the output has V's.

Pools of dtype int8 are 8-bit quantized with a scale per row (ops/kv_quant.py): the write
quantizes, the attention dequantizes the gathered rows to the query's dtype.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlxserve.ops import kv_quant
from mlxserve.ops.metadata import AttentionMetadata


def write_kv(
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_head_dim)
    v_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, v_head_dim)
    keys: mx.array,  # (num_tokens, num_kv_heads, k_head_dim)
    values: mx.array,  # (num_tokens, num_kv_heads, v_head_dim)
    slot_mapping: mx.array,  # (num_tokens,) int32
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V rows into their slots (8-bit pools: quantized first); returns the
    updated pools. The caller must drop the old pools so MLX can update them in place."""
    if kv_quant.is_quantized(k_cache):
        keys, values = kv_quant.quantize(keys), kv_quant.quantize(values)
    return scatter_rows(k_cache, v_cache, keys, values, slot_mapping)


def scatter_rows(
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_width)
    v_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, v_width)
    k_rows: mx.array,  # (num_tokens, num_kv_heads, k_width), pool rows as stored
    v_rows: mx.array,  # (num_tokens, num_kv_heads, v_width)
    slot_mapping: mx.array,  # (num_tokens,) int32
) -> tuple[mx.array, mx.array]:
    """MLX's scatter of pool rows into their slots: the one pool write on every backend.

    In place when the old pools can be donated (see ops/metal.py): nothing but this call may
    hold them, and they must be row-contiguous (the reshapes below are then views).
    """
    k_flat = k_cache.reshape(-1, *k_cache.shape[2:])  # (num_slots, num_kv_heads, k_width)
    v_flat = v_cache.reshape(-1, *v_cache.shape[2:])  # (num_slots, num_kv_heads, v_width)
    k_flat[slot_mapping] = k_rows.astype(k_cache.dtype)
    v_flat[slot_mapping] = v_rows.astype(v_cache.dtype)
    return k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)


def paged_attention(
    q: mx.array,  # (num_tokens, num_heads, k_head_dim)
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_head_dim)
    v_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, v_head_dim)
    md: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,  # (num_heads,)
) -> mx.array:  # (num_tokens, num_heads, v_head_dim)
    """Varlen attention: batched decodes first, then one causal block per prefill chunk.

    GQA is folded into the query rows so each KV head is read once per group and the
    score matmul is one (group * q_len, head_dim) x (head_dim, ctx) product.
    """
    num_tokens, num_heads, _ = q.shape
    v_head_dim = kv_quant.pool_head_dim(v_cache)
    outs = []
    if md.num_decodes:
        qd = q[: md.num_decodes]
        outs.append(_decode_attention(qd, k_cache, v_cache, md, scale, window, sinks))
    start = md.num_decodes
    for i in range(md.num_decodes, md.num_reqs):
        q_len, ctx = md.query_lens[i], md.context_lens_host[i]
        qi = q[start : start + q_len]
        outs.append(
            _prefill_attention(qi, k_cache, v_cache, md.block_tables[i], ctx, scale, window, sinks)
        )
        start += q_len
    if start < num_tokens:  # bucketing padding: rows nobody reads
        outs.append(mx.zeros((num_tokens - start, num_heads, v_head_dim), dtype=q.dtype))
    return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def _gather_context(
    cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    tables: mx.array,  # (..., num_ctx_blocks) int32
    dtype: mx.Dtype,
) -> mx.array:  # (..., num_ctx_blocks * block_size, num_kv_heads, head_dim) dtype
    blocks = cache[tables]  # (..., num_ctx_blocks, block_size, num_kv_heads, head_dim)
    shape = blocks.shape
    rows = blocks.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return kv_quant.dequantize(rows, dtype) if kv_quant.is_quantized(cache) else rows


_LOG2_E = math.log2(math.e)


def _exp(x: mx.array) -> mx.array:
    """exp(x); on the CPU as 2^(x log2 e), within float32 rounding of it: MLX's CPU exp
    costs ~20 ns an element, its power ~6, and a softmax over a long context is mostly
    exps (one per query row per key)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.power(2.0, x * _LOG2_E)
    return mx.exp(x)


def _softmax(
    scores: mx.array,  # (..., L) float32
    sink: mx.array | None,  # broadcastable to (..., 1) float32
) -> mx.array:  # (..., L) float32
    """Softmax over the last axis; a sink logit joins the denominator only."""
    m = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        m = mx.maximum(m, sink)
    e = _exp(scores - m)
    denom = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + _exp(sink - m)
    return e / denom


def _gather_rows(
    cache: mx.array,  # (num_blocks, block_size, num_kv_heads, width)
    rows: mx.array,  # (...) int32: flat row index, slot * num_kv_heads + kv head
    dtype: mx.Dtype,
) -> mx.array:  # (..., head_dim) dtype
    """Pool rows (one token of one KV head each) by flat index, dequantized if needed.

    Indexing rows rather than blocks lays the keys out head-major, (kvh, L, head_dim),
    as the matmuls want them, without the transposing copy a block gather needs.
    """
    flat = cache.reshape(-1, cache.shape[-1])  # (num_slots * num_kv_heads, width)
    out = flat[rows]
    return kv_quant.dequantize(out, dtype) if kv_quant.is_quantized(cache) else out


def _decode_attention(
    q: mx.array,  # (num_decodes, num_heads, k_head_dim)
    k_cache: mx.array,
    v_cache: mx.array,
    md: AttentionMetadata,
    scale: float,
    window: int | None,
    sinks: mx.array | None,
) -> mx.array:  # (num_decodes, num_heads, v_head_dim)
    """One query row per decode, attending up to its own position. A run of rows of one
    request (``md.decode_group_sizes``: a speculative verification) is one group: its
    keys are gathered once and its R rows are R more rows of one matmul::

        group j:  keys of its table, gathered once      (kvh, L, head_dim)
                  queries  r = 0..R-1, x GQA group       (kvh, R * group, head_dim)
                  row r sees keys at positions < its own context length
    """
    num_decodes, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    key = ("decode", block_size, num_kv_heads, window)
    if key not in md.derived:  # the same for every layer of the step: made once
        md.derived[key] = _decode_context(md, block_size, num_kv_heads, window)
    rows, keys, valid, unpad = md.derived[key]
    num_groups, _, num_keys = keys.shape
    r = valid.shape[2]  # query rows per group (shorter groups padded)
    qr = q if rows is None else q[rows]  # (G * R, num_heads, head_dim)
    qg = qr.reshape(num_groups, r, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(num_groups, num_kv_heads, r * group, head_dim)  # row = t * group + g
    k = _gather_rows(k_cache, keys, q.dtype)  # (G, kvh, L, head_dim)
    v = _gather_rows(v_cache, keys, q.dtype)  # (G, kvh, L, v_head_dim)
    v_head_dim = v.shape[-1]
    scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32) * scale  # (G, kvh, R * group, L)
    scores = scores.reshape(num_groups, num_kv_heads, r, group, num_keys)
    scores = mx.where(valid, scores, -mx.inf)
    sink = None
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, num_kv_heads, 1, group, 1)
    probs = _softmax(scores, sink).astype(v.dtype)  # (G, kvh, R, group, L)
    out = probs.reshape(num_groups, num_kv_heads, r * group, num_keys) @ v
    out = out.reshape(num_groups, num_kv_heads, r, group, v_head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_groups * r, num_heads, v_head_dim)
    return out if unpad is None else out[unpad]


def _decode_context(
    md: AttentionMetadata, block_size: int, num_kv_heads: int, window: int | None
) -> tuple[mx.array | None, mx.array, mx.array, mx.array | None]:
    """The decode groups' layout: each padded query row's decode row (None: one row per
    group), the flat pool row of each gathered key (G, kvh, L), which keys each query row
    sees (G, 1, R, 1, L), and each decode row's padded row (None: no padding)."""
    num_decodes = md.num_decodes
    sizes = md.decode_group_sizes or (1,) * num_decodes
    assert sum(sizes) == num_decodes, (sizes, num_decodes)
    num_groups, r = len(sizes), max(sizes)
    starts = np.cumsum((0, *sizes[:-1]))  # each group's first decode row
    offsets = np.minimum(np.arange(r)[None], np.asarray(sizes)[:, None] - 1)  # (G, R)
    padded = starts[:, None] + offsets  # (G, R): the decode row each query row repeats
    ctx_host = np.asarray(md.context_lens_host[:num_decodes], dtype=np.int32)
    ctx = mx.array(ctx_host[padded])  # (G, R) each query row's context length
    first_ctx = ctx[:, 0]  # (G,)
    tables = md.block_tables[mx.array(starts.astype(np.int32))]  # (G, max_blocks)
    num_ctx_blocks = -(-md.max_decode_context_len // block_size)
    if window is None or window >= md.max_decode_context_len:
        first = mx.zeros((num_groups,), dtype=mx.int32)  # first gathered block
        tables = tables[:, :num_ctx_blocks]
    else:
        # Keys (first_ctx - window, last_ctx] span at most this many blocks.
        span = window + r - 1
        num_ctx_blocks = min(num_ctx_blocks, (span - 1) // block_size + 2)
        first = mx.maximum(first_ctx - window, 0) // block_size
        # Stay inside the table; starting earlier still covers the window.
        first = mx.minimum(first, tables.shape[1] - num_ctx_blocks)
        idx = first[:, None] + mx.arange(num_ctx_blocks)[None]  # (G, num_ctx_blocks)
        tables = mx.take_along_axis(tables, idx, axis=1)
    num_keys = tables.shape[1] * block_size
    offset = mx.arange(num_keys)  # (L,)
    slots = tables[:, offset // block_size] * block_size + offset % block_size  # (G, L)
    keys = slots[:, None, :] * num_kv_heads + mx.arange(num_kv_heads)[None, :, None]
    pos = first[:, None] * block_size + offset[None]  # (G, L) key positions
    valid = pos[:, None, :] < ctx[:, :, None]  # (G, R, L)
    if window is not None:
        valid = valid & (pos[:, None, :] >= ctx[:, :, None] - window)
    rows = unpad = None
    if r > 1:
        rows = mx.array(padded.reshape(-1).astype(np.int32))
        real = [j * r + t for j, n in enumerate(sizes) for t in range(n)]
        unpad = mx.array(np.asarray(real, dtype=np.int32))
    return rows, keys.astype(mx.int32), valid[:, None, :, None, :], unpad


def _prefill_attention(
    q: mx.array,  # (q_len, num_heads, k_head_dim)
    k_cache: mx.array,
    v_cache: mx.array,
    table: mx.array,  # (max_blocks,) int32
    ctx: int,
    scale: float,
    window: int | None,
    sinks: mx.array | None,
) -> mx.array:  # (q_len, num_heads, v_head_dim)
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    v_head_dim = kv_quant.pool_head_dim(v_cache)
    group = num_heads // num_kv_heads
    num_ctx_blocks = -(-ctx // block_size)
    # The first query (position ctx - q_len) sees keys from ctx - q_len - window + 1 on.
    first_block = 0 if window is None else max(ctx - q_len - window + 1, 0) // block_size
    start = first_block * block_size  # position of the first gathered key
    blocks = table[first_block:num_ctx_blocks]
    k = _gather_context(k_cache, blocks, q.dtype)[: ctx - start]  # (L, kvh, head_dim)
    v = _gather_context(v_cache, blocks, q.dtype)[: ctx - start]  # (L, kvh, v_head_dim)
    # Fold the GQA group into rows: (kvh, group * q_len, head_dim), row = g * q_len + t.
    qg = q.reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * q_len, head_dim)
    scores = (qg @ k.transpose(1, 2, 0)).astype(mx.float32) * scale  # (kvh, group*q_len, L)
    # Query t sits at position ctx - q_len + t and sees keys up to it (and, with a
    # window, after its position - window).
    q_pos = mx.arange(ctx - q_len, ctx)[:, None]
    k_pos = mx.arange(start, ctx)[None, :]
    visible = k_pos <= q_pos  # (q_len, L)
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    visible = mx.tile(visible, (group, 1))  # (group * q_len, L)
    scores = mx.where(visible[None], scores, -mx.inf)
    sink = None
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(num_kv_heads, group, 1)
        sink = mx.repeat(sink, q_len, axis=1)  # (kvh, group * q_len, 1): row g * q_len + t
    probs = _softmax(scores, sink).astype(v.dtype)
    out = probs @ v.transpose(1, 0, 2)  # (kvh, group * q_len, v_head_dim)
    out = out.reshape(num_kv_heads, group, q_len, v_head_dim).transpose(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, v_head_dim)
