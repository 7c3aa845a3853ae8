"""Finding the request that made a step fail, by re-running halves of the step.

Each request's computation depends only on its own tokens and KV blocks (which is why
batch invariance holds), so any subset of a step's requests is a valid step that gives
those requests the same results. A step that raises is therefore re-run in halves::

    [a b c d e f g h] raises
      [a b c d] ok           -> their tokens are the step's tokens
      [e f g h] raises
        [e f] ok
        [g h] raises
          [g] ok  [h] raises -> h failed; the others continue, token-exact

One culprit among n requests costs about 2 log2(n) re-runs. Re-running a request writes
the same K/V into the same slots, so a step that got half-way before failing does no harm.
A build (or re-run) that raises before its graph is evaluated leaves lazy writes in the
pool's arrays: a PoolSnapshot taken before it puts the evaluated arrays back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxserve.core.scheduler import SchedulerOutput
from mlxserve.models.base import KVCache
from mlxserve.worker.drafter import Drafter

logger = logging.getLogger("mlxserve")


class KVCacheLostError(RuntimeError):
    """The K/V pool could not be evaluated after a failed step: every request's KV is gone."""


@dataclass
class PoolSnapshot:
    """The pool's arrays (the target model's and the draft model's) before a build."""

    keys: list[mx.array]
    values: list[mx.array]
    states: list[list[mx.array]]
    drafter: tuple | None  # what drafter.save() returned

    @classmethod
    def take(cls, kv_cache: KVCache, drafter: Drafter | None) -> PoolSnapshot:
        """The arrays as they are now (holding them keeps MLX from updating them in place)."""
        saved = None if drafter is None else drafter.save()
        states = [list(arrays) for arrays in kv_cache.states]
        return cls(list(kv_cache.keys), list(kv_cache.values), states, saved)

    def arrays(self) -> list[mx.array]:
        """The arrays in the order of the runner's pool arrays (the target's keys, values,
        states, then the draft model's keys and values)."""
        drafter = [] if self.drafter is None else [a for part in self.drafter for a in part]
        return [*self.keys, *self.values, *(a for s in self.states for a in s), *drafter]

    def restore(self, kv_cache: KVCache, drafter: Drafter | None) -> None:
        """Put the arrays back (drops the lazy writes of a failed build)."""
        kv_cache.keys[:], kv_cache.values[:] = self.keys, self.values
        for arrays, saved in zip(kv_cache.states, self.states, strict=True):
            arrays[:] = saved
        if self.drafter is not None:
            drafter.restore(self.drafter)


def describe(error: BaseException) -> str:
    """An exception in one line (kept instead of the exception: its traceback pins arrays)."""
    return f"{type(error).__name__}: {error}"


def bisect(
    so: SchedulerOutput,
    error: str,
    failed: dict[str, str],
    run: Callable[[SchedulerOutput], str | None],
) -> None:
    """Split the failed step ``so`` in halves and ``run`` each (it returns its error or None).

    Recurses into halves that fail; a request that fails alone goes into ``failed`` with
    its error. Requests already in ``failed`` are left out.
    """
    requests = [r for r in so.scheduled_requests if r.request_id not in failed]
    if len(requests) == 1:
        request_id = requests[0].request_id
        logger.error("request %s fails a step on its own: %s", request_id, error)
        failed[request_id] = error
        return
    mid = len(requests) // 2
    for half in (requests[:mid], requests[mid:]):
        if not half:
            continue
        sub = so.subset(half)
        sub_error = run(sub)
        if sub_error is not None:
            bisect(sub, sub_error, failed, run)
