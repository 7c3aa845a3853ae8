"""Metal memory limits from the plan (worker/metal_memory.py), on a faked Metal device."""

from __future__ import annotations

import logging

import pytest

from mlxserve.utils import GiB
from mlxserve.worker.metal_memory import MIN_CACHE_BYTES, set_metal_limits

M2_16GB = {"memory_size": 16 * GiB, "max_recommended_working_set_size": 10 * GiB}


def fake(info=M2_16GB, wired_error: Exception | None = None):
    calls: dict[str, list[int]] = {"wired": [], "cache": []}

    def set_wired(n: int) -> int:
        if wired_error:
            raise wired_error
        calls["wired"].append(n)
        return 0

    def set_cache(n: int) -> int:
        calls["cache"].append(n)
        return 0

    kw = dict(
        available=lambda: True,
        device_info=lambda: info,
        set_wired_limit=set_wired,
        set_cache_limit=set_cache,
    )
    return calls, kw


def test_wired_is_weights_plus_pool_and_cache_is_the_rest_of_the_budget(caplog) -> None:
    caplog.set_level(logging.INFO, logger="mlxserve")
    calls, kw = fake()
    limits = set_metal_limits(1 * GiB, 3 * GiB, 0.5, **kw)
    # budget 0.5 x 10 GiB = 5 GiB; resident 4 GiB; the activations' 1 GiB is the cache
    assert calls == {"wired": [4 * GiB], "cache": [1 * GiB]}
    assert limits is not None and limits.working_set == 10 * GiB
    assert "wired limit 4.00 GiB" in caplog.text and "cache limit 1.00 GiB" in caplog.text


def test_a_pool_past_the_working_set_is_capped_and_warned(caplog) -> None:
    calls, kw = fake()
    set_metal_limits(4 * GiB, 8 * GiB, 0.9, **kw)
    assert calls["wired"] == [int(10 * GiB * 0.95)]  # strictly below the working set
    assert calls["cache"] == [MIN_CACHE_BYTES]  # nothing left in the budget: the floor
    assert "exceed Metal's recommended working set (10.00 GiB)" in caplog.text


def test_a_refused_wired_limit_is_a_warning_not_a_failure(caplog) -> None:
    calls, kw = fake(wired_error=RuntimeError("[metal::set_wired_limit] too large"))
    limits = set_metal_limits(1 * GiB, 1 * GiB, 0.5, **kw)
    assert limits is not None and limits.wired == 0 and calls["cache"] == [3 * GiB]
    assert "sysctl iogpu.wired_limit_mb" in caplog.text


def test_nothing_is_set_without_metal() -> None:
    calls, kw = fake()
    kw["available"] = lambda: False
    assert set_metal_limits(1 * GiB, 1 * GiB, 0.5, **kw) is None
    assert calls == {"wired": [], "cache": []}


def test_working_set_missing_falls_back_to_memory_size() -> None:
    calls, kw = fake(info={"memory_size": 8 * GiB})
    set_metal_limits(1 * GiB, 1 * GiB, 0.5, **kw)
    assert calls["cache"] == [2 * GiB]


@pytest.mark.parametrize("fraction", [0.25, 0.9])
def test_limits_follow_memory_fraction(fraction: float) -> None:
    calls, kw = fake()
    set_metal_limits(GiB // 2, GiB // 2, fraction, **kw)
    assert calls["cache"] == [max(int(10 * GiB * fraction) - GiB, MIN_CACHE_BYTES)]
