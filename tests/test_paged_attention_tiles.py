"""The CPU paged-attention primitive's tiles: rows of one table read each key once, and
every row keeps the bits it has alone (issues 17, 18)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import cpu
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
