"""PoolWatch: notice when a step copied a KV pool array instead of updating it in place.

The pool write is MLX's scatter (mlxserve/ops/metal.py), in place only while nothing but the
KV cache holds the old pool arrays. A stray reference (a list kept across a step, a debug
hook) does not change any result, it turns each step's write into a full copy of every
pool: slower, and twice the pool's memory at the peak. The runner shows the watch its pool
arrays after each step it waited for; an array whose shape is unchanged but whose buffer
moved was copied, and the engine warns once.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

logger = logging.getLogger("mlxserve")


def buffer_address(a: mx.array) -> int:
    """Address of an evaluated array's data (waits for it if it is still being computed)."""
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


class PoolWatch:
    """Compares the pool arrays' buffers step to step; keeps addresses, never the arrays
    (holding them would itself prevent the in-place update)."""

    def __init__(self) -> None:
        self._last: list[tuple[tuple[int, ...], int]] | None = None
        self.num_copied_steps = 0  # steps in which at least one pool array was copied

    def check(self, arrays: list[mx.array]) -> int:
        """Record the pool after a step; how many of its arrays the step copied.

        Arrays whose shape changed (the pool grew) or a pool of another length (a new
        cache) are not counted: their buffers move legitimately.
        """
        now = [(tuple(a.shape), buffer_address(a)) for a in arrays]
        last, self._last = self._last, now
        if last is None or len(last) != len(now):
            return 0
        copied = sum(
            1 for (s0, a0), (s1, a1) in zip(last, now, strict=True) if s0 == s1 and a0 != a1
        )
        if copied:
            self.num_copied_steps += 1
            if self.num_copied_steps == 1:
                logger.warning(
                    "a step copied %d of %d KV pool arrays instead of updating them in place: "
                    "something holds a reference to the old pool, so every step now costs a "
                    "copy of those pools (results are unaffected). Please report this.",
                    copied,
                    len(now),
                )
        return copied

    def forget(self) -> None:
        """Start over: the pool was replaced or deliberately copied (a failed step's re-run
        holds the old arrays to restore them)."""
        self._last = None
