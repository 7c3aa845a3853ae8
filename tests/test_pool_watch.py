"""PoolWatch (worker/pool_watch.py) on hand-made pools: which steps it compares, what it
counts as a copy, and its one warning. The engine test in test_engine.py runs it for real."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from mlxserve.worker.pool_watch import PoolWatch, buffer_address


def _pools(n: int = 3, blocks: int = 4) -> list[mx.array]:
    pools = [mx.zeros((blocks, 2, 1, 8)) for _ in range(n)]
    mx.eval(pools)
    return pools


def test_buffer_address_is_numpy_s_view_of_the_same_data() -> None:
    for a in (*_pools(1), mx.ones((3, 8), dtype=mx.bfloat16), mx.ones((5,), dtype=mx.int8)):
        mx.eval(a)
        assert buffer_address(a) == np.frombuffer(memoryview(a), np.uint8).ctypes.data


def test_a_pool_that_is_not_row_contiguous_is_named_once(caplog) -> None:
    """The scatter only writes a row-contiguous pool in place: a pool left otherwise after
    a step is reported (once), with its strides, and not compared."""
    caplog.set_level(logging.WARNING, logger="mlxserve")
    transposed = mx.zeros((8, 4)).T
    mx.eval(transposed)
    watch = PoolWatch(every=1)
    assert [watch.check([transposed]), watch.check([transposed])] == [0, 0]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "a KV pool array (4, 8) is not row-contiguous (strides (4, 16))" in warning
    assert watch.num_copied_steps == 0


def test_copies_are_counted_on_the_compared_pairs_of_steps(caplog) -> None:
    """every=8: calls 8k and 8k + 1 are compared. A pool copied at every step (fresh
    buffers, the old still alive) is seen there, once per pair, with one warning; the same
    buffers, a grown pool or another pool length are never a copy."""
    caplog.set_level(logging.WARNING, logger="mlxserve")
    watch = PoolWatch()
    alive = []  # keep each step's pools alive so no address is reused
    seen = []
    for _ in range(17):
        alive.append(_pools())
        seen.append(watch.check(alive[-1]))
    assert [i + 1 for i, n in enumerate(seen) if n] == [9, 17]  # 1-based calls 8k + 1
    assert seen[8] == 3 and watch.num_copied_steps == 2
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "copied 3 of 3 KV pool arrays instead of updating them in place" in warning

    same = PoolWatch(every=1)
    pools = _pools()
    grown = [mx.concatenate([p, p]) for p in pools]
    mx.eval(grown)
    checks = [same.check(pools), same.check(pools), same.check(grown), same.check(grown[:2])]
    assert checks == [0, 0, 0, 0]
    assert same.num_copied_steps == 0
    same.check(grown[:2])
    same.forget()  # a re-run copied the pool on purpose: not compared
    assert same.check(_pools(2, blocks=8)) == 0


def test_a_step_that_writes_each_pool_twice_is_counted_apart_without_a_warning(caplog) -> None:
    """Pipeline micro-batches write a pool twice in one evaluation; their copies (a timing
    matter) are counted apart and not reported; a single-write step's copy still is."""
    caplog.set_level(logging.WARNING, logger="mlxserve")
    watch = PoolWatch(every=1)
    alive = [_pools(2)]
    watch.check(alive[-1])
    alive.append(_pools(2))
    assert watch.check(alive[-1], rewrites=True) == 2
    assert (watch.num_rewrite_copied_steps, watch.num_copied_steps) == (1, 0)
    assert not caplog.records
    alive.append(_pools(2))
    assert watch.check(alive[-1]) == 2
    assert (watch.num_rewrite_copied_steps, watch.num_copied_steps) == (1, 1)
    assert len(caplog.records) == 1
