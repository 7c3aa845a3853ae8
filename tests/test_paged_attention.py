"""The paged-attention ops against a plainly written dense attention (numpy): the pure-MLX
fallback (the reference) and, where they are built, mlxserve's CPU primitives (mlxserve/cpu/ops.py:
decode and verification rows in one op, MLX's scatter built in C++ for the write)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import ops
from mlxserve.cpu import kernels as cpu
from mlxserve.ops import AttentionMetadata

BACKENDS = ("fallback", "cpu")


def use_backend(name: str) -> None:
    """Skip (or fail, where CI requires them) a "cpu" case when the primitives are not built."""
    if name == "cpu" and not cpu.available():
        if os.environ.get("MLXSERVE_REQUIRE_CPU_KERNELS"):
            pytest.fail(f"MLXSERVE_REQUIRE_CPU_KERNELS is set: {cpu.status()}")
        pytest.skip(cpu.status())


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test taking it runs on the fallback and on the CPU primitives."""
    use_backend(request.param)
    with ops.force_backend(request.param):
        yield request.param


TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3}


def dense_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    window: int | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal attention of the last q_len positions over a contiguous sequence.

    q: (q_len, H, D); k: (ctx, KVH, D); v: (ctx, KVH, Dv). Written per head with explicit
    loops. ``window``: the query at position p sees positions p - window + 1 .. p.
    ``sinks``: (H,) logits that count in the softmax denominator only.
    """
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = np.zeros((q_len, num_heads, v.shape[-1]), dtype=np.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
        for t in range(q_len):
            end = ctx - q_len + t + 1
            begin = 0 if window is None else max(0, end - window)
            s = kh[begin:end] @ q[t, h].astype(np.float64) * scale
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - m)
            denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[t, h] = (p / denom) @ vh[begin:end]
    return out


def make_case(
    rng: np.random.Generator,
    block_size: int,
    requests: list[tuple[int, int]],  # (query_len, context_len), decodes first
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
):
    """Random sequences placed in a pool through shuffled block tables."""
    blocks_per_req = [-(-ctx // block_size) for _, ctx in requests]
    num_blocks = 1 + sum(blocks_per_req) + 3  # null block + spare
    free = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_req]
    seqs_k = [
        rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32) for _, ctx in requests
    ]
    seqs_v = [
        rng.standard_normal((ctx, num_kv_heads, v_head_dim or head_dim)).astype(np.float32)
        for _, ctx in requests
    ]
    qs = [
        rng.standard_normal((q_len, num_heads, head_dim)).astype(np.float32)
        for q_len, _ in requests
    ]
    return tables, num_blocks, seqs_k, seqs_v, qs


def run_paged(
    requests, tables, num_blocks, seqs_k, seqs_v, qs, block_size, dtype, scale, **variant
):
    num_kv_heads, head_dim = seqs_k[0].shape[1:]
    k_pool = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pool = np.full((*k_pool.shape[:3], seqs_v[0].shape[-1]), np.nan, np.float32)
    # Cached prefix goes straight into the pool; the new tokens go through write_kv.
    new_k, new_v = [], []
    for (q_len, ctx), table, k, v in zip(requests, tables, seqs_k, seqs_v, strict=True):
        for pos in range(ctx - q_len):
            k_pool[table[pos // block_size], pos % block_size] = k[pos]
            v_pool[table[pos // block_size], pos % block_size] = v[pos]
        new_k.append(k[ctx - q_len :])
        new_v.append(v[ctx - q_len :])
    md = AttentionMetadata.build(
        [q for q, _ in requests], [c for _, c in requests], tables, block_size
    )
    k_cache = mx.array(np.nan_to_num(k_pool, nan=1e4)).astype(dtype)
    v_cache = mx.array(np.nan_to_num(v_pool, nan=1e4)).astype(dtype)
    k_cache, v_cache = ops.write_kv(
        k_cache,
        v_cache,
        mx.array(np.concatenate(new_k)).astype(dtype),
        mx.array(np.concatenate(new_v)).astype(dtype),
        md.slot_mapping,
    )
    out = ops.paged_attention(
        mx.array(np.concatenate(qs)).astype(dtype), k_cache, v_cache, md, scale, **variant
    )
    return np.array(out.astype(mx.float32))


def lengths_for(block_size: int) -> list[tuple[int, int]]:
    """Decodes at 1, bs-1, bs, bs+1 and many blocks; fresh and chunked prefills."""
    bs = block_size
    decode_ctx = sorted({1, max(bs - 1, 1), bs, bs + 1, 5 * bs + 3})
    prefills = [(bs + 2, bs + 2), (3, 2 * bs + 1), (min(bs, 7), 4 * bs)]
    return [(1, c) for c in decode_ctx] + prefills


def _grid() -> list:
    """Block sizes x GQA x dtypes at head size 64, and head size 128 at block sizes 1, 16
    and 128, on the fallback; the CPU primitive at head size 64 and four block sizes (the
    block and head loops of both do not depend on the head size's value)."""
    cases = []
    for backend in BACKENDS:
        for block_size in (1, 2, 5, 16, 32, 128):
            for gqa in (1, 2, 3, 8):
                for head_dim in (64, 128):
                    if head_dim == 128 and (backend == "cpu" or block_size not in (1, 16, 128)):
                        continue
                    if backend == "cpu" and block_size in (2, 32):
                        continue
                    for dtype, name in ((mx.float32, "fp32"), (mx.float16, "fp16")):
                        ids = f"{backend}-{block_size}-{gqa}-{head_dim}-{name}"
                        args = (backend, block_size, gqa, head_dim, dtype)
                        cases.append(pytest.param(*args, id=ids))
    return cases


@pytest.mark.parametrize("backend,block_size,gqa,head_dim,dtype", _grid(), indirect=["backend"])
def test_fallback_matches_dense(backend, block_size: int, gqa: int, head_dim: int, dtype) -> None:
    rng = np.random.default_rng(block_size * 1000 + gqa * 10 + head_dim)
    num_kv_heads = 2
    num_heads = num_kv_heads * gqa
    requests = lengths_for(block_size)
    if block_size >= 32:  # keep the many-block cases small enough to run fast
        requests = [(q, min(c, 3 * block_size + 1)) for q, c in requests]
    tables, num_blocks, ks, vs, qs = make_case(
        rng, block_size, requests, num_heads, num_kv_heads, head_dim
    )
    scale = head_dim**-0.5
    got = run_paged(requests, tables, num_blocks, ks, vs, qs, block_size, dtype, scale)
    # The reference sees the same rounding of inputs to dtype as the kernel does.
    rnd = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731
    want = np.concatenate(
        [dense_attention(rnd(q), rnd(k), rnd(v), scale) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    np.testing.assert_allclose(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_padding_rows_and_only_decodes(backend: str) -> None:
    rng = np.random.default_rng(0)
    requests = [(1, 7), (1, 1)]
    tables, num_blocks, ks, vs, qs = make_case(rng, 4, requests, 4, 2, 64)
    got = run_paged(requests, tables, num_blocks, ks, vs, qs, 4, mx.float32, 0.125)
    want = np.concatenate(
        [dense_attention(q, k, v, 0.125) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_write_kv_updates_only_its_slots(backend: str) -> None:
    k = mx.zeros((4, 2, 1, 3))
    v = mx.zeros((4, 2, 1, 3))
    new = mx.arange(6, dtype=mx.float32).reshape(2, 1, 3) + 1
    k, v = ops.write_kv(k, v, new, -new, mx.array([3, 6], dtype=mx.int32))
    flat_k = np.array(k).reshape(8, 3)
    assert flat_k[3].tolist() == [1, 2, 3] and flat_k[6].tolist() == [4, 5, 6]
    assert np.count_nonzero(flat_k) == 6
    assert np.array(v).reshape(8, 3)[6].tolist() == [-4, -5, -6]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 4, 9, 40, None])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["nosinks", "sinks"])
def test_window_and_sinks_match_dense(
    block_size: int, window: int | None, use_sinks, backend: str
) -> None:
    """Sliding windows smaller than, equal to and larger than blocks and contexts, with and
    without attention sinks; decodes (gathering only the window's blocks) and prefills."""
    rng = np.random.default_rng(block_size * 100 + (window or 0) * 2 + use_sinks)
    num_kv_heads, gqa, head_dim = 2, 3, 16
    num_heads = num_kv_heads * gqa
    requests = lengths_for(block_size) + [(1, 3 * block_size + 5)]
    requests = sorted(requests, key=lambda r: r[0] != 1)  # decodes first
    tables, num_blocks, ks, vs, qs = make_case(
        rng, block_size, requests, num_heads, num_kv_heads, head_dim
    )
    sinks = (2 * rng.standard_normal(num_heads)).astype(np.float32) if use_sinks else None
    scale = head_dim**-0.5
    variant = {"window": window, "sinks": None if sinks is None else mx.array(sinks)}
    got = run_paged(
        requests, tables, num_blocks, ks, vs, qs, block_size, mx.float32, scale, **variant
    )
    want = np.concatenate(
        [dense_attention(q, k, v, scale, window, sinks) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_window_changes_the_output(backend: str) -> None:
    """The window cases above would pass vacuously if the window were ignored."""
    rng = np.random.default_rng(1)
    requests = [(1, 13), (5, 12)]
    tables, num_blocks, ks, vs, qs = make_case(rng, 4, requests, 4, 2, 16)
    full = run_paged(requests, tables, num_blocks, ks, vs, qs, 4, mx.float32, 0.25)
    windowed = run_paged(requests, tables, num_blocks, ks, vs, qs, 4, mx.float32, 0.25, window=3)
    assert np.abs(full - windowed).max(axis=(1, 2)).min() > 1e-2  # every token changes


@pytest.mark.parametrize("window", [None, 5])
def test_k_and_v_head_sizes_may_differ(window: int | None, backend: str) -> None:
    """MLA-style layers cache keys of one head size and values of another."""
    rng = np.random.default_rng(3)
    requests = [(1, 9), (1, 2), (6, 6), (3, 11)]
    tables, num_blocks, ks, vs, qs = make_case(rng, 4, requests, 4, 4, 24, v_head_dim=16)
    got = run_paged(requests, tables, num_blocks, ks, vs, qs, 4, mx.float32, 0.2, window=window)
    assert got.shape == (sum(q for q, _ in requests), 4, 16)
    want = np.concatenate(
        [dense_attention(q, k, v, 0.2, window) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_window_must_be_positive() -> None:
    k = mx.zeros((2, 4, 1, 8))
    md = AttentionMetadata.build([1], [1], [[1]], 4)
    with pytest.raises(ValueError, match="window must be >= 1 token, got 0"):
        ops.paged_attention(mx.zeros((1, 1, 8)), k, k, md, 1.0, window=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 3, 9])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["nosinks", "sinks"])
def test_verification_rows_match_dense(
    block_size: int, window: int | None, use_sinks, backend: str
) -> None:
    """Decode rows of one request at consecutive positions (a speculative verification:
    the last token and its drafts) are one group that gathers the keys once; each row
    still sees exactly the keys up to its own position, as the causal dense reference."""
    rng = np.random.default_rng(block_size * 10 + (window or 0) + 100 * use_sinks)
    num_kv_heads, gqa, head_dim = 2, 3, 16
    num_heads = num_kv_heads * gqa
    # (rows, context length after the last row): groups of 1, 5, 3 and 2 rows.
    groups = [(1, 7), (5, 3 * block_size + 4), (3, 2 * block_size + 1), (2, 3)]
    requests, tables, ks, vs, qs, want = [], [], [], [], [], []
    blocks = rng.permutation(np.arange(1, 200)).tolist()
    for rows, ctx in groups:
        table = [blocks.pop() for _ in range(-(-ctx // block_size))]
        k = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32)
        q = rng.standard_normal((rows, num_heads, head_dim)).astype(np.float32)
        for t in range(rows):  # one decode entry per row, all on the request's table
            end = ctx - rows + 1 + t
            requests.append((1, end))
            tables.append(table)
            ks.append(k[:end])
            vs.append(v[:end])
            qs.append(q[t : t + 1])
        want.append((q, k, v))
    md = AttentionMetadata.build(
        [q for q, _ in requests], [c for _, c in requests], tables, block_size
    )
    assert md.decode_group_sizes == (1, 5, 3, 2)
    sinks = (2 * rng.standard_normal(num_heads)).astype(np.float32) if use_sinks else None
    variant = {"window": window, "sinks": None if sinks is None else mx.array(sinks)}
    got = run_paged(requests, tables, 200, ks, vs, qs, block_size, mx.float32, 0.25, **variant)
    expected = np.concatenate([dense_attention(q, k, v, 0.25, window, sinks) for q, k, v in want])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)


def test_decode_groups_need_one_table_and_consecutive_positions() -> None:
    """Rows are grouped only when they are one request's consecutive positions."""
    build = AttentionMetadata.build
    assert build([1, 1, 1], [5, 6, 7], [[1, 2]] * 3, 4).decode_group_sizes == (3,)
    assert build([1, 1], [5, 7], [[1, 2]] * 2, 4).decode_group_sizes == ()  # a gap
    assert build([1, 1], [5, 6], [[1, 2], [1, 3]], 4).decode_group_sizes == ()  # two tables
    md = build([1, 1, 1, 4], [3, 4, 9, 4], [[1], [1], [2, 3, 4], [5]], 4)
    assert md.decode_group_sizes == (2, 1)  # the prefill chunk is not a decode


@pytest.mark.parametrize("window", [None, 20])
def test_cpu_rows_do_not_depend_on_their_chunk(window: int | None) -> None:
    """On the CPU primitives a token's attention has the same bits whatever chunk of its
    prompt it is computed in: whole, in chunks of any size, after a cached prefix, beside
    another request, or as a decode row. (The fallback's causal matmul per chunk changes in
    the last bits with the chunk's shape; int8 activations, rounding x per block, turned
    that into greedy answers that depended on the server's chunking.)"""
    use_backend("cpu")
    rng = np.random.default_rng(18)
    n, bs = 45, 16
    # Request 0 is another sequence's decode row, request 1 the prompt.
    tables, num_blocks, ks, vs, qs = make_case(rng, bs, [(1, 20), (n, n)], 9, 3, 64)

    def rows(chunks: list[int], beside: bool = False) -> np.ndarray:
        """The prompt's rows computed chunk by chunk (``beside``: after the decode row)."""
        out, start = [], 0
        for size in chunks:
            end = start + size
            picked = [(0, (1, 20), 20, slice(0, 1))] if beside else []  # decodes first
            picked.append((1, (size, end), end, slice(start, end)))
            with ops.force_backend("cpu"):
                got = run_paged(
                    [r for _, r, _, _ in picked],
                    [tables[i] for i, _, _, _ in picked],
                    num_blocks,
                    [ks[i][:c] for i, _, c, _ in picked],
                    [vs[i][:c] for i, _, c, _ in picked],
                    [qs[i][s] for i, _, _, s in picked],
                    bs,
                    mx.float32,
                    0.125,
                    window=window,
                )
            out.append(got[len(picked) - 1 :])  # the prompt's rows
            start = end
        return np.concatenate(out)

    whole = rows([n])
    want = dense_attention(qs[1], ks[1], vs[1], 0.125, window)
    np.testing.assert_allclose(whole, want, atol=2e-5, rtol=2e-5)  # right, to start with
    for chunks, beside in [([8, 17, 20], False), ([32, 13], False), ([3, 42], True)]:
        np.testing.assert_array_equal(rows(chunks, beside), whole, err_msg=str(chunks))
    np.testing.assert_array_equal(rows([1] * n), whole, err_msg="decode rows")
