"""Pure-MLX attention over the block pool: runs everywhere, and defines what is correct.

The Metal kernels are tested against these functions; these are tested against a
plainly written dense attention (tests/test_paged_attention.py).
"""

from __future__ import annotations

import mlx.core as mx

from mlxserve.ops.metadata import AttentionMetadata


def write_kv(
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    keys: mx.array,  # (num_tokens, num_kv_heads, head_dim)
    values: mx.array,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: mx.array,  # (num_tokens,) int32
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V rows into their slots; returns the updated pools.

    The caller must drop its reference to the old pools so MLX can update them in place.
    """
    shape = k_cache.shape
    rows = shape[0] * shape[1]
    k_flat = k_cache.reshape(rows, shape[2], shape[3])
    v_flat = v_cache.reshape(rows, shape[2], shape[3])
    k_flat[slot_mapping] = keys.astype(k_cache.dtype)
    v_flat[slot_mapping] = values.astype(v_cache.dtype)
    return k_flat.reshape(shape), v_flat.reshape(shape)


def paged_attention(
    q: mx.array,  # (num_tokens, num_heads, head_dim)
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    md: AttentionMetadata,
    scale: float,
) -> mx.array:  # (num_tokens, num_heads, head_dim)
    """Varlen attention: batched decodes first, then one causal block per prefill chunk.

    GQA is folded into the query rows so each KV head is read once per group and the
    score matmul is one (group * q_len, head_dim) x (head_dim, ctx) product.
    """
    num_tokens, num_heads, head_dim = q.shape
    outs = []
    if md.num_decodes:
        outs.append(_decode_attention(q[: md.num_decodes], k_cache, v_cache, md, scale))
    start = md.num_decodes
    for i in range(md.num_decodes, md.num_reqs):
        q_len, ctx = md.query_lens[i], md.context_lens_host[i]
        qi = q[start : start + q_len]
        outs.append(_prefill_attention(qi, k_cache, v_cache, md.block_tables[i], ctx, scale))
        start += q_len
    if start < num_tokens:  # bucketing padding: rows nobody reads
        outs.append(mx.zeros((num_tokens - start, num_heads, head_dim), dtype=q.dtype))
    return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def _gather_context(
    cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    tables: mx.array,  # (..., num_ctx_blocks) int32
) -> mx.array:  # (..., num_ctx_blocks * block_size, num_kv_heads, head_dim)
    blocks = cache[tables]  # (..., num_ctx_blocks, block_size, num_kv_heads, head_dim)
    shape = blocks.shape
    return blocks.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])


def _decode_attention(
    q: mx.array,  # (num_decodes, num_heads, head_dim)
    k_cache: mx.array,
    v_cache: mx.array,
    md: AttentionMetadata,
    scale: float,
) -> mx.array:  # (num_decodes, num_heads, head_dim)
    num_decodes, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_ctx_blocks = -(-md.max_decode_context_len // block_size)
    tables = md.block_tables[:num_decodes, :num_ctx_blocks]  # (num_decodes, num_ctx_blocks)
    k = _gather_context(k_cache, tables).transpose(0, 2, 3, 1)  # (B, kvh, head_dim, L)
    v = _gather_context(v_cache, tables).transpose(0, 2, 1, 3)  # (B, kvh, L, head_dim)
    qg = q.reshape(num_decodes, num_kv_heads, group, head_dim)  # (B, kvh, group, head_dim)
    scores = (qg @ k).astype(mx.float32) * scale  # (B, kvh, group, L)
    ctx_len = k.shape[-1]
    valid = mx.arange(ctx_len)[None, :] < md.context_lens[:num_decodes, None]  # (B, L)
    scores = mx.where(valid[:, None, None, :], scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1).astype(v.dtype)  # (B, kvh, group, L)
    out = probs @ v  # (B, kvh, group, head_dim)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(
    q: mx.array,  # (q_len, num_heads, head_dim)
    k_cache: mx.array,
    v_cache: mx.array,
    table: mx.array,  # (max_blocks,) int32
    ctx: int,
    scale: float,
) -> mx.array:  # (q_len, num_heads, head_dim)
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_ctx_blocks = -(-ctx // block_size)
    k = _gather_context(k_cache, table[:num_ctx_blocks])[:ctx]  # (ctx, kvh, head_dim)
    v = _gather_context(v_cache, table[:num_ctx_blocks])[:ctx]  # (ctx, kvh, head_dim)
    # Fold the GQA group into rows: (kvh, group * q_len, head_dim), row = g * q_len + t.
    qg = q.reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * q_len, head_dim)
    scores = (qg @ k.transpose(1, 2, 0)).astype(mx.float32) * scale  # (kvh, group*q_len, ctx)
    # Query t sits at position ctx - q_len + t and sees keys 0 .. ctx - q_len + t.
    q_pos = mx.arange(ctx - q_len, ctx)
    causal = mx.arange(ctx)[None, :] <= q_pos[:, None]  # (q_len, ctx)
    causal = mx.tile(causal, (group, 1))  # (group * q_len, ctx)
    scores = mx.where(causal[None], scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1).astype(v.dtype)
    out = probs @ v.transpose(1, 0, 2)  # (kvh, group * q_len, head_dim)
    out = out.reshape(num_kv_heads, group, q_len, head_dim).transpose(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_dim)
