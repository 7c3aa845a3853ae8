"""Paged-attention test cases: build a block pool, run the ops, compare Metal with the fallback.

Used by tests/test_metal_*.py. A case is a batch of requests, each (query_len, context_len)
with decodes first, laid out in a pool through shuffled block tables. Pool slots that hold
no token are filled with a large finite value, so a kernel that reads outside a context gets
a visibly wrong answer (NaN would poison the fallback's masked matmul too).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxserve import ops
from mlxserve.ops import AttentionMetadata, kv_quant
from mlxserve.ops.metal import MetalConfig

# The kernels' exponentials are metal::fast::exp, which the shim (metal_stdlib.h) gives its
# worst-case error of (3 + floor(|2x|)) ulp: for the softmax weights that matter (x in
# [-17, 0]) at most 37 ulp, ~4e-6 relative. float32 keeps its 2e-5: the largest error seen
# on the float32 cases of tests/test_metal_kernels.py (head_dim 256, multi-query) is 3.6e-6.
# The 16-bit tolerances are set by the pool dtype's rounding instead.
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
GARBAGE = 1.0e4
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class Case:
    """One batch: requests as (query_len, context_len), decodes first."""

    requests: tuple[tuple[int, int], ...]
    block_size: int
    gqa: int
    head_dim: int
    dtype: str = "float32"
    num_kv_heads: int = 2
    pad_tokens: int = 0  # bucketing padding rows after the real tokens
    seed: int = 0
    window: int | None = None  # sliding window (tokens)
    sinks: bool = False  # per-head attention sinks
    kv_quant: bool = False  # 8-bit pools with a scale per row (ops/kv_quant.py)


def decode_requests(block_size: int) -> tuple[tuple[int, int], ...]:
    """Decodes with contexts 1, bs-1, bs, bs+1 and several blocks."""
    bs = block_size
    return tuple((1, c) for c in sorted({1, max(bs - 1, 1), bs, bs + 1, 4 * bs + 3}))


def mixed_requests(block_size: int) -> tuple[tuple[int, int], ...]:
    """Decodes, a fresh prefill, and chunked prefills whose chunks cross block edges."""
    bs = block_size
    return ((1, bs + 1), (1, 2), (bs + 2, bs + 2), (3, 2 * bs + 1), (min(bs, 7), 3 * bs))


@dataclass
class Inputs:
    md: AttentionMetadata
    q: np.ndarray  # (num_tokens, num_heads, head_dim) float32, padding rows zero
    keys: np.ndarray  # (num_tokens, num_kv_heads, head_dim)
    values: np.ndarray
    k_pool: np.ndarray  # (num_blocks, block_size, num_kv_heads, head_dim), before the write
    v_pool: np.ndarray
    scale: float
    window: int | None = None
    sinks: np.ndarray | None = None  # (num_heads,) float32
    kv_quant: bool = False


def make_inputs(case: Case) -> Inputs:
    """Random sequences placed in a pool through shuffled block tables."""
    rng = np.random.default_rng(case.seed)
    bs, kvh, hd = case.block_size, case.num_kv_heads, case.head_dim
    heads = kvh * case.gqa
    blocks_per_req = [-(-ctx // bs) for _, ctx in case.requests]
    num_blocks = 1 + sum(blocks_per_req) + 2  # null block 0 + spare
    free = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_req]
    k_pool = np.full((num_blocks, bs, kvh, hd), GARBAGE, np.float32)
    v_pool = np.full_like(k_pool, -GARBAGE)
    new_k, new_v, qs = [], [], []
    for (q_len, ctx), table in zip(case.requests, tables, strict=True):
        k = rng.standard_normal((ctx, kvh, hd)).astype(np.float32)
        v = rng.standard_normal((ctx, kvh, hd)).astype(np.float32)
        for pos in range(ctx - q_len):  # the cached prefix
            k_pool[table[pos // bs], pos % bs] = k[pos]
            v_pool[table[pos // bs], pos % bs] = v[pos]
        new_k.append(k[ctx - q_len :])
        new_v.append(v[ctx - q_len :])
        qs.append(rng.standard_normal((q_len, heads, hd)).astype(np.float32))
    num_tokens = sum(q for q, _ in case.requests)
    md = AttentionMetadata.build(
        [q for q, _ in case.requests],
        [c for _, c in case.requests],
        tables,
        bs,
        num_tokens_padded=num_tokens + case.pad_tokens,
    )
    pad = ((0, case.pad_tokens), (0, 0), (0, 0))
    return Inputs(
        md=md,
        q=np.pad(np.concatenate(qs), pad),
        keys=np.pad(np.concatenate(new_k), pad),
        values=np.pad(np.concatenate(new_v), pad),
        k_pool=k_pool,
        v_pool=v_pool,
        scale=hd**-0.5,
        window=case.window,
        # Sinks around the scores' scale, so they matter without swamping them.
        sinks=(2 * rng.standard_normal(heads)).astype(np.float32) if case.sinks else None,
        kv_quant=case.kv_quant,
    )


def to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def run(
    inp: Inputs, dtype: str, backend: Callable[[], AbstractContextManager]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ops.write_kv then ops.paged_attention under `backend`, as a layer calls them; returns
    (out, k_pool, v_pool) as float32 (8-bit pools: their bytes)."""
    dt = DTYPES[dtype]
    k_cache = mx.array(inp.k_pool).astype(dt)
    v_cache = mx.array(inp.v_pool).astype(dt)
    if inp.kv_quant:
        k_cache, v_cache = kv_quant.quantize(k_cache), kv_quant.quantize(v_cache)
    mx.eval(k_cache, v_cache)
    with backend():
        keys, values = mx.array(inp.keys).astype(dt), mx.array(inp.values).astype(dt)
        k_cache, v_cache = ops.write_kv(k_cache, v_cache, keys, values, inp.md.slot_mapping)
        out = ops.paged_attention(
            mx.array(inp.q).astype(dt),
            k_cache,
            v_cache,
            inp.md,
            inp.scale,
            window=inp.window,
            sinks=None if inp.sinks is None else mx.array(inp.sinks),
        )
        mx.eval(out, k_cache, v_cache)
    return to_numpy(out), to_numpy(k_cache), to_numpy(v_cache)


def fallback_backend() -> AbstractContextManager:
    return ops.force_backend("fallback")


def metal_backend(factory=None, config: MetalConfig | None = None):
    """A backend() for run(): Metal kernels from `factory` (None: mx.fast.metal_kernel)."""
    return lambda: ops.force_backend("metal", factory, config)


def split_config(block_size: int) -> MetalConfig:
    """Always split decodes (in mixed batches too), with partitions that end inside blocks."""
    return MetalConfig(partition_size=2 * block_size - 3, split_min_context=1, gpu_cores=1 << 20)


def check(case: Case, metal: Callable[[], AbstractContextManager]) -> None:
    """Assert the Metal path matches the fallback: attention within the dtype's tolerance,
    pools bitwise equal (the write is a copy in the pool dtype)."""
    inp = make_inputs(case)
    want_out, want_k, want_v = run(inp, case.dtype, fallback_backend)
    got_out, got_k, got_v = run(inp, case.dtype, metal)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_array_equal(got_k, want_k, err_msg="k_cache after write_kv")
    np.testing.assert_array_equal(got_v, want_v, err_msg="v_cache after write_kv")
    np.testing.assert_allclose(got_out, want_out, atol=tol, rtol=tol, err_msg="attention output")
