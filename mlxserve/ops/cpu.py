"""Attention ops through mlxserve's CPU primitives (csrc/attn_ext.cpp, rope_norm_ext.cpp).

On MLX's CPU backend the fallback's decode attention is ~25 small ops per layer (gathers
through the block table, transposes, a masked softmax) and the pool write ~12 (Python's
indexing adds squeezes, broadcasts and reshapes), each dispatched on its own (~11 us an
op here). With the extension loaded (mlxserve/cpu):

* decode rows (and a speculative verification's rows: one request's consecutive rows,
  each up to its own position) are one ``paged_attention`` op per layer, for float32,
  float16, bfloat16 and int8 pools, GQA, sliding windows, sinks and K/V head sizes that
  differ;
* prefill chunks stay on the fallback (one causal matmul per chunk: BLAS does that well);
* the K/V write is MLX's scatter built in C++ (``write_rows``): the same Scatter primitive,
  in place when the pool can be donated, with no extra ops around it.

The fallback (ops/fallback.py) stays the reference these are tested against
(tests/test_paged_attention.py runs both against a dense attention).
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from mlxserve.ops import fallback, kv_quant
from mlxserve.ops.metadata import AttentionMetadata

# The last slot mapping's (block ids, offsets): every layer of a step writes the same slots,
# so they are split once per step, not once per layer. One tuple, replaced whole: a thread
# building another graph meanwhile (pipeline stages) never sees half of an update.
_last_slots: tuple[mx.array, int, mx.array, mx.array] | None = None


def _block_offsets(slot_mapping: mx.array, block_size: int) -> tuple[mx.array, mx.array]:
    global _last_slots
    memo = _last_slots
    if memo is None or memo[0] is not slot_mapping or memo[1] != block_size:
        slots = slot_mapping.astype(mx.int32)
        memo = (slot_mapping, block_size, slots // block_size, slots % block_size)
        _last_slots = memo
    return memo[2], memo[3]


def write_kv(
    module: ModuleType,
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_width)
    v_cache: mx.array,
    keys: mx.array,  # (num_tokens, num_kv_heads, k_head_dim) or (num_tokens, 1, 1, ...)
    values: mx.array,
    slot_mapping: mx.array,  # (num_tokens,) int32
) -> tuple[mx.array, mx.array]:
    """fallback.write_kv with MLX's scatter built in C++ (no ops around it; rows already in
    the scatter's (num_tokens, 1, 1, heads, width) shape, as the fused layer makes them,
    need no reshape either); the old pools are consumed (drop them so the scatter can update
    them in place)."""
    if kv_quant.is_quantized(k_cache):
        keys, values = kv_quant.quantize(keys), kv_quant.quantize(values)
    blocks, offsets = _block_offsets(slot_mapping, k_cache.shape[1])
    return (
        module.write_rows(k_cache, blocks, offsets, keys),
        module.write_rows(v_cache, blocks, offsets, values),
    )


def paged_attention(
    module: ModuleType,
    q: mx.array,  # (num_tokens, num_heads, k_head_dim)
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_width)
    v_cache: mx.array,
    md: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,  # (num_heads,)
) -> mx.array:  # (num_tokens, num_heads, v_head_dim)
    """fallback.paged_attention with every decode row in the primitive."""
    if md.num_decodes == 0:
        return fallback.paged_attention(q, k_cache, v_cache, md, scale, window, sinks)
    tables, ctx, rows = md.block_tables, md.context_lens, md.num_decodes

    def decode(qd: mx.array) -> mx.array:  # rows from num_decodes on come out as zeros
        return module.paged_attention(
            qd, k_cache, v_cache, tables, ctx, rows, scale, window or 0, sinks
        )

    if md.num_decodes == md.num_reqs:  # only decodes (and bucketing padding): one op
        return decode(q)
    return fallback.paged_attention(q, k_cache, v_cache, md, scale, window, sinks, decode=decode)
