"""Attention ops through mlxserve's CPU primitives (csrc/attn_ext.cpp, rope_norm_ext.cpp).

On MLX's CPU backend the fallback's decode attention is ~25 small ops per layer (gathers
through the block table, transposes, a masked softmax) and the pool write ~12 (Python's
indexing adds squeezes, broadcasts and reshapes), each dispatched on its own (~11 us an
op here). With the extension loaded (mlxserve/cpu/kernels.py):

* every row of a step (decode rows, a speculative verification's rows, prefill chunks'
  rows: each attends to its sequence's keys up to its own position) is one
  ``paged_attention`` op per layer, for float32, float16, bfloat16 and int8 pools, GQA,
  sliding windows, sinks and K/V head sizes that differ. A token's attention is then one
  fixed sequence of float32 operations over its keys, whatever chunk it came in and
  whatever else the step holds: the same bits whether a prompt is computed whole, in
  chunks of any size or after a prefix-cache hit, and the same as a decode row's. (The
  fallback's causal matmul per chunk changes in the last bits with the chunk's shape,
  which int8 activations, rounding x per block, can turn into whole quanta: greedy
  answers at near ties then depended on the server's chunking.) It also costs less CPU
  time than the fallback's chunk matmuls and softmax (bench/README.md);
* the K/V write is MLX's scatter built in C++ (``write_rows``): the same Scatter primitive,
  in place when the pool can be donated, with no extra ops around it.

The fallback (ops/fallback.py) stays the reference these are tested against
(tests/test_paged_attention.py runs both against a dense attention).

Importing this module registers it with mlxserve.ops as the CPU backend (its
``primitives``, ``status``, ``write_kv`` and ``paged_attention``): ops chooses when they
run, and looks them up here on each call.
"""

from __future__ import annotations

import sys
from types import ModuleType

import mlx.core as mx
import numpy as np

from mlxserve import ops
from mlxserve.cpu import kernels
from mlxserve.ops import kv_quant
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
    """fallback.paged_attention with every row in the primitive (padding rows: zeros)."""
    tables, ctx, rows = step_rows(md)
    return module.paged_attention(q, k_cache, v_cache, tables, ctx, rows, scale, window or 0, sinks)


def step_rows(md: AttentionMetadata) -> tuple[mx.array, mx.array, int]:
    """Each token's block table and context length (up to its own position) and the number
    of tokens: made once per step, shared by the layers."""
    if md.num_decodes == md.num_reqs:  # one row per request already
        return md.block_tables, md.context_lens, md.num_decodes
    key = ("cpu rows",)
    if key not in md.derived:
        lens, ctx = np.asarray(md.query_lens), np.asarray(md.context_lens_host)
        req = np.repeat(np.arange(md.num_reqs, dtype=np.int32), lens)
        first = np.repeat(ctx - lens, lens)  # position of each request's first new token
        pos = first + np.arange(len(req)) - np.repeat(np.cumsum(lens) - lens, lens)
        md.derived[key] = (md.block_tables[mx.array(req)], mx.array((pos + 1).astype(np.int32)))
    tables, ctx_rows = md.derived[key]
    return tables, ctx_rows, ctx_rows.shape[0]


def primitives() -> ModuleType | None:
    """The extension's primitives (built on the first call), or None where they cannot be
    used here (:func:`status` says why)."""
    return kernels.module()


def status() -> str:
    """One line: the CPU kernels in use, or why not."""
    return kernels.status()


ops.register_cpu_backend(sys.modules[__name__])
