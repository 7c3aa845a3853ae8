"""PoolWatch: notice when a step copied a KV pool array instead of updating it in place.

The pool write is MLX's scatter (mlxserve/ops/metal.py), in place only while nothing but the
KV cache holds the old pool arrays. A stray reference (a list kept across a step, a debug
hook) does not change any result, it turns each step's write into a full copy of every
pool: slower, and twice the pool's memory at the peak. The runner shows the watch its pool
arrays after each step it waited for; an array whose shape is unchanged but whose buffer
moved was copied, and the engine warns once. A pool array that is not row-contiguous (which
the scatter cannot donate; the engine never makes one) is named in a warning too.

A step that writes each pool more than once in one evaluation (pipeline micro-batches on
rank 0) is counted apart, without a warning: MLX holds a kernel's input buffers until the
kernel has finished, so a later write of a pool is in place only if the earlier
micro-batch's attention has already run when MLX dispatches it; on a busy CPU it sometimes
has not (the PP test's scenario: none of 29 such steps on an idle machine, 3-6 of 29 at
a load of 5 on 2 cores). A step writing each pool once never copies.
"""

from __future__ import annotations

import ctypes
import logging

import mlx.core as mx
import numpy as np

logger = logging.getLogger("mlxserve")


def buffer_address(a: mx.array) -> int:
    """Address of an evaluated row-contiguous array's data (waits for it if it is still
    being computed); ValueError for an array that is not row-contiguous."""
    view = memoryview(a)
    if not view.c_contiguous:
        raise ValueError(f"array {a.shape} is not row-contiguous (strides {view.strides})")
    if view.readonly:
        return np.frombuffer(view, dtype=np.uint8).ctypes.data
    # ~0.5 us; numpy's view takes ~10 (the runner asks for every pool array)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class PoolWatch:
    """Compares the pool arrays' buffers across two consecutive steps out of every `every`
    (reading ~100 addresses costs ~50 us: not every step); keeps addresses, never the
    arrays (holding them would itself prevent the in-place update)."""

    def __init__(self, every: int = 8) -> None:
        self.every = every  # 1: every step
        self._calls = 0
        self._last: list[tuple[tuple[int, ...], int]] | None = None
        self.num_copied_steps = 0  # compared steps in which a pool array was copied
        self.num_rewrite_copied_steps = 0  # the same, among steps writing a pool twice+
        self._warned: set[str] = set()

    def check(self, arrays: list[mx.array], rewrites: bool = False) -> int:
        """Show the watch the pool after a step; how many of its arrays the step copied
        (0 when this step is not compared). ``rewrites``: the step wrote each pool more
        than once (counted apart, no warning).

        Arrays whose shape changed (the pool grew) or a pool of another length (a new
        cache) are not counted: their buffers move legitimately.
        """
        self._calls += 1
        phase = self._calls % self.every
        if self.every > 1 and phase > 1:  # record at phase 0, compare at phase 1
            return 0
        try:
            now = [(tuple(a.shape), buffer_address(a)) for a in arrays]
        except ValueError as e:  # the scatter only donates row-contiguous pools
            self._last = None
            self._warn_once("layout", f"a KV pool {e}: it cannot be updated in place")
            return 0
        last, self._last = self._last, now
        if last is None or len(last) != len(now) or (self.every > 1 and phase == 0):
            return 0
        copied = sum(
            1 for (s0, a0), (s1, a1) in zip(last, now, strict=True) if s0 == s1 and a0 != a1
        )
        if copied and rewrites:
            self.num_rewrite_copied_steps += 1
            logger.debug("a step writing each KV pool more than once copied %d of them", copied)
        elif copied:
            self.num_copied_steps += 1
            self._warn_once(
                "copy",
                f"a step copied {copied} of {len(now)} KV pool arrays instead of updating them "
                "in place: something holds a reference to the old pool, so every step now "
                "costs a copy of those pools (results are unaffected)",
            )
        return copied

    def forget(self) -> None:
        """Start over: the pool was replaced or deliberately copied (a failed step's re-run
        holds the old arrays to restore them)."""
        self._last = None

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s. Please report this.", message)
