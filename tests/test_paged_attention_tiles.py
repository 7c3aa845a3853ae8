"""The CPU paged-attention primitive's tiles: rows of one table read each key once, and
every row keeps the bits it has alone (issues 17, 18)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.cpu import kernels as cpu
from mlxserve.ops import kv_quant
from tests.test_paged_attention import use_backend

BLOCK, BLOCKS = 16, 24


def reference(q, k, v, table, c, scale, window, sinks) -> np.ndarray:
    """One row over positions [lo, c) read through its table, float64, per head."""
    heads, kv_heads = q.shape[0], k.shape[2]
    lo = max(0, c - window) if window else 0
    pos = np.arange(lo, c)
    slots = table[pos // BLOCK], pos % BLOCK
    out = np.zeros((heads, v.shape[-1]))
    for h in range(heads):
        kh = k[slots[0], slots[1], h // (heads // kv_heads)].astype(np.float64)
        vh = v[slots[0], slots[1], h // (heads // kv_heads)].astype(np.float64)
        s = kh @ q[h].astype(np.float64) * scale
        m = max(s.max(initial=-np.inf), -np.inf if sinks is None else float(sinks[h]))
        p = np.exp(s - m)
        denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
        out[h] = p @ vh / denom if denom > 0 else 0.0
    return out


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim,window,with_sinks", [(64, 0, False), (24, 7, True)])
def test_cpu_tiled_rows_keep_their_bits(
    int8: bool, head_dim: int, window: int, with_sinks: bool
) -> None:
    """A verification/prefill run of one table, rows of tables sharing a prefix, empty and
    far-apart rows in one call: each row's result has the bits of the row computed alone,
    and matches a float64 attention read through the table."""
    use_backend("cpu")
    rng = np.random.default_rng(17)
    heads, kv_heads = 8, 2
    shape = (BLOCKS, BLOCK, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k_pool, v_pool = mx.array(k), mx.array(v)
    if int8:
        k_pool, v_pool = kv_quant.quantize(k_pool), kv_quant.quantize(v_pool)
        k = np.array(kv_quant.dequantize(k_pool, mx.float32))
        v = np.array(kv_quant.dequantize(v_pool, mx.float32))
    t1 = rng.permutation(BLOCKS).astype(np.int32)[:20]
    t2 = t1.copy()
    t2[3:] = np.roll(t1[3:], 1)  # shares t1's first 3 blocks
    rows = [(t1, c) for c in range(180, 199)]  # one request's 19 consecutive rows
    rows += [(t2, 40), (t1, 45), (t2, 300), (t1, 0), (t1, 3), (t1, 250), (t1, 60)]
    n = len(rows)
    q = rng.standard_normal((n + 2, heads, head_dim)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) if with_sinks else None
    tables = np.stack([t for t, _ in rows] + [t1, t1])
    ctx = np.array([c for _, c in rows] + [5, 5], np.int32)
    scale = head_dim**-0.5

    def call(picked: list[int], num_rows: int) -> np.ndarray:
        """The primitive over the picked rows."""
        s = None if sinks is None else mx.array(sinks)
        args = (mx.array(q[picked]), k_pool, v_pool, mx.array(tables[picked]))
        return np.array(
            cpu.module().paged_attention(*args, mx.array(ctx[picked]), num_rows, scale, window, s)
        )

    together = call(list(range(n + 2)), n)
    np.testing.assert_array_equal(together[n:], 0.0)  # padding rows
    for r, (table, c) in enumerate(rows):
        np.testing.assert_array_equal(together[r], call([r], 1)[0], err_msg=f"row {r}")
        want = reference(q[r], k, v, table, c, scale, window, sinks)
        np.testing.assert_allclose(together[r], want, atol=2e-5, rtol=2e-5, err_msg=f"row {r}")


def exp_sequence(x: np.ndarray) -> np.ndarray:
    """attn_ext.cpp's exp_keys replayed in numpy float32, operation by operation."""
    f = np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.minimum(np.where(x < f(-87), f(-87), x), f(88)).astype(f)
        n = (xc * f(1.44269504) + f(12582912)) - f(12582912)
        r = xc - n * f(0.693359375)
        r = r - n * f(-2.12194440e-4)
        poly = r * f(1.9875691500e-4) + f(1.3981999507e-3)
        for c in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            poly = poly * r + f(c)
        y = (poly * (r * r) + r) + f(1)
        ints = np.where(np.isfinite(n), n, 0).astype(np.int32)
        two_n = ((ints + 127) << 23).astype(np.int32).view(f)
        e = np.where(x < f(-87), f(0), y * two_n)
    return np.where(np.isnan(x), x, e).astype(f)


def replay_row(q, k, v, table, c, scale, window, sinks) -> np.ndarray:
    """One row's attention as the primitive's fixed float32 sequence (attn_ext.cpp): each
    score a dot product in 16 partial sums over the head size (d % 16, in order) halved
    8/4/2/1, plus the tail; softmax numerators by exp_keys, summed in 16 partial sums over
    the keys (k % 16) halved, plus the sink's; values weighted and added key by key; times
    1 / the sum. Every instruction set must give these bits."""
    f = np.float32
    heads, kv_heads, dk = q.shape[0], k.shape[2], q.shape[1]
    lo = max(0, c - window) if window else 0
    pos = np.arange(lo, c)
    out = np.zeros((heads, v.shape[-1]), f)
    for h in range(heads):
        kh = k[table[pos // BLOCK], pos % BLOCK, h // (heads // kv_heads)]  # (n, dk)
        vh = v[table[pos // BLOCK], pos % BLOCK, h // (heads // kv_heads)]
        acc = np.zeros((16, len(pos)), f)
        full = dk // 16 * 16
        for i in range(0, full, 16):
            for u in range(16):
                acc[u] = acc[u] + q[h, i + u] * kh[:, i + u]
        tail = np.zeros(len(pos), f)
        for i in range(full, dk):
            tail = tail + q[h, i] * kh[:, i]
        for w in (8, 4, 2, 1):
            acc[:w] = acc[:w] + acc[w : 2 * w]
        s = (acc[0] + tail) * f(scale)
        m = s.max(initial=-np.inf)
        if sinks is not None:
            m = max(m, sinks[h])
        e = exp_sequence((s - f(m)).astype(f))
        part = np.zeros(16 * (-(-len(e) // 16)), f)
        part[: len(e)] = e
        sums = np.zeros(16, f)
        for j in range(0, len(part), 16):
            sums = sums + part[j : j + 16]
        for w in (8, 4, 2, 1):
            sums[:w] = sums[:w] + sums[w : 2 * w]
        denom = sums[0]
        if sinks is not None:
            denom = denom + exp_sequence(np.array([sinks[h] - f(m)], f))[0]
        a = np.zeros(v.shape[-1], f)
        for j in range(len(e)):
            a = a + e[j] * vh[j]
        out[h] = a * (f(1) / denom) if denom > 0 else f(0)
    return out


@pytest.mark.parametrize("head_dim,window,with_sinks", [(64, 0, False), (24, 7, True)])
def test_cpu_rows_are_one_fixed_float32_sequence(
    head_dim: int, window: int, with_sinks: bool
) -> None:
    """The primitive's outputs have exactly the bits of replay_row's float32 sequence (so
    every instruction set and tile gives them), for a prefill run of one table (tiles),
    lone rows and key counts off the 16-key groups; and the exponent itself is within 1
    ulp of float64's exp down to -87 (0 below), NaN stays NaN."""
    use_backend("cpu")
    rng = np.random.default_rng(5)
    heads, kv_heads = 6, 2
    shape = (BLOCKS, BLOCK, kv_heads, head_dim)
    k = (rng.standard_normal(shape) * 2).astype(np.float32)  # scores spread over exp's range
    v = rng.standard_normal(shape).astype(np.float32)
    table = rng.permutation(BLOCKS).astype(np.int32)
    ctx = np.array([*range(40, 58), 1, 16, 17, 250, 0], np.int32)
    q = (rng.standard_normal((len(ctx), heads, head_dim)) * 3).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    got = np.array(
        cpu.module().paged_attention(
            mx.array(q), mx.array(k), mx.array(v), mx.array(np.tile(table, (len(ctx), 1))),
            mx.array(ctx), len(ctx), scale, window, None if sinks is None else mx.array(sinks),
        )
    )  # fmt: skip
    for r, c in enumerate(ctx):
        want = replay_row(q[r], k, v, table, int(c), scale, window, sinks)
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r} (context {c})")
    x = np.concatenate([-np.geomspace(1e-8, 87, 5000), [0.0, -87.0, -87.5, -np.inf]])
    e = exp_sequence(x.astype(np.float32))
    exact = np.exp(x.astype(np.float32).astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(e - exact) <= ulp)[x >= -87].all()
    assert (e[x < -87] == 0).all() and np.isnan(exp_sequence(np.array([np.nan], np.float32)))


@pytest.mark.parametrize(
    "kv_heads,window,with_sinks", [(1, 0, False), (2, 0, True), (3, 300, False)]
)
def test_a_lone_row_split_over_threads_keeps_the_bits(
    kv_heads: int, window: int, with_sinks: bool
) -> None:
    """One decode row has as many work items as KV heads, fewer than two threads need: its
    scores, softmax and value sums run as three parallel loops over parts of the keys and
    value elements. The bits stay replay_row's, at 1-4 threads, over 1,500 keys."""
    use_backend("cpu")
    rng = np.random.default_rng(7)
    heads, head_dim, blocks = 3 * kv_heads, 64, 100
    shape = (blocks, BLOCK, kv_heads, head_dim)
    k = (rng.standard_normal(shape) * 2).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    table = rng.permutation(blocks).astype(np.int32)[None]
    q = (rng.standard_normal((1, heads, head_dim)) * 3).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    module = cpu.module()
    before = module.threads()
    try:
        for threads in (1, 2, 3, 4):
            module.set_threads(threads)
            for c in (1500, 1493):
                got = np.array(
                    module.paged_attention(
                        mx.array(q), mx.array(k), mx.array(v), mx.array(table),
                        mx.array(np.array([c], np.int32)), 1, scale, window,
                        None if sinks is None else mx.array(sinks),
                    )
                )  # fmt: skip
                want = replay_row(q[0], k, v, table[0], c, scale, window, sinks)
                np.testing.assert_array_equal(got[0], want, err_msg=f"{threads} threads, {c} keys")
    finally:
        module.set_threads(before)
