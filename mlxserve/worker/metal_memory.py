"""MLX's Metal memory limits, set from the engine's memory plan instead of left at defaults.

On Metal, MLX's defaults are a wired limit of 0 (macOS may page the weights and the KV pool
out of GPU-resident memory under pressure: a slow first token after idling) and a buffer
cache as large as the memory limit (freed activation buffers are kept, so the process holds
far more than its plan). With a plan in hand:

    wired limit  = weights + KV pool, capped below Metal's recommended working set
                   (and below the system's wired limit: MLX raises above it)
    cache limit  = what the memory budget leaves after weights and KV pool: the activations'
                   room, so their buffers are reused but never hoard what the pool planned on

The plan itself already keeps weights + pool inside memory_fraction x the recommended
working set (worker/memory.py); a pool forced larger (num_blocks) is warned about here,
since running past the working set is where macOS stalls or aborts on a GPU out-of-memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from mlxserve.utils import GiB

logger = logging.getLogger("mlxserve")

MIN_CACHE_BYTES = 64 * 1024 * 1024  # room for a step's small temporaries at least


@dataclass(frozen=True)
class MetalLimits:
    """The limits chosen, for the start-up log and tests."""

    wired: int
    cache: int
    working_set: int

    def describe(self) -> str:
        return (
            f"Metal memory: wired limit {self.wired / GiB:.2f} GiB (weights + KV pool), cache "
            f"limit {self.cache / GiB:.2f} GiB, recommended working set "
            f"{self.working_set / GiB:.2f} GiB"
        )


def plan_limits(
    working_set: int, budget: int, weights_bytes: int, kv_bytes: int
) -> tuple[MetalLimits, str | None]:
    """(limits, warning or None) for a plan: `budget` is memory_fraction x `working_set`."""
    resident = weights_bytes + kv_bytes
    # Strictly below the working set (MLX's rule for the wired limit), with some slack.
    wired = min(resident, int(working_set * 0.95))
    cache = max(budget - resident, MIN_CACHE_BYTES)
    warning = None
    if resident > working_set:
        warning = (
            f"weights ({weights_bytes / GiB:.2f} GiB) + KV pool ({kv_bytes / GiB:.2f} GiB) "
            f"exceed Metal's recommended working set ({working_set / GiB:.2f} GiB): expect "
            "paging or GPU out-of-memory aborts; use fewer num_blocks or a smaller model"
        )
    return MetalLimits(wired, cache, working_set), warning


def set_metal_limits(
    weights_bytes: int,
    kv_bytes: int,
    memory_fraction: float,
    *,
    available: Callable[[], bool],
    device_info: Callable[[], dict],
    set_wired_limit: Callable[[int], int],
    set_cache_limit: Callable[[int], int],
) -> MetalLimits | None:
    """Set MLX's wired and cache limits from the plan; None (nothing set) without Metal.

    The callables are mx.metal.is_available, mx.device_info, mx.set_wired_limit and
    mx.set_cache_limit (injected, so the logic is tested on Linux with a faked device).
    """
    if not available():
        return None
    info = device_info()
    working_set = int(info.get("max_recommended_working_set_size") or info["memory_size"])
    budget = int(working_set * memory_fraction)
    limits, warning = plan_limits(working_set, budget, weights_bytes, kv_bytes)
    if warning:
        logger.warning("%s", warning)
    try:
        set_wired_limit(limits.wired)
    except (RuntimeError, ValueError) as e:  # above the system's wired limit (sysctl)
        logger.warning(
            "could not set MLX's wired limit to %.2f GiB (%s); weights and KV pool may be "
            "paged out (raise it with `sudo sysctl iogpu.wired_limit_mb=...`)",
            limits.wired / GiB,
            e,
        )
        limits = MetalLimits(0, limits.cache, working_set)
    set_cache_limit(limits.cache)
    logger.info("%s", limits.describe())
    return limits


def configure(weights_bytes: int, kv_bytes: int, memory_fraction: float) -> MetalLimits | None:
    """set_metal_limits with MLX's own functions (the engine calls this after planning)."""
    import mlx.core as mx

    return set_metal_limits(
        weights_bytes,
        kv_bytes,
        memory_fraction,
        available=mx.metal.is_available,
        device_info=mx.device_info,
        set_wired_limit=mx.set_wired_limit,
        set_cache_limit=mx.set_cache_limit,
    )
