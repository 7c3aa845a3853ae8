"""The Metal shim's newer builtins, run through the emulator against numpy."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from metal.checker.emulator import Emulator

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulator runs on Linux")


def _run(source: str, x: np.ndarray, out_shape: tuple[int, ...], threads: int) -> np.ndarray:
    k = Emulator().metal_kernel("shim", ["x"], ["out"], source)
    (out,) = k(
        inputs=[mx.array(x)],
        output_shapes=[out_shape],
        output_dtypes=[mx.float32],
        grid=(threads, 1, 1),
        threadgroup=(min(threads, 256), 1, 1),
    )
    return np.array(out)


def test_fast_exp_carries_the_fast_math_error_bound() -> None:
    """fast::exp is off libm's exp by up to (3 + floor(|2x|)) ulp, never more, and does
    move (so kernel tests face the fast variant's error, not a correctly rounded exp)."""
    x = np.linspace(-20.0, 4.0, 1001, dtype=np.float32)
    got = _run(
        "out[thread_position_in_grid.x] = metal::fast::exp(x[thread_position_in_grid.x]);",
        x,
        x.shape,
        x.size,
    ).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    bound = 3 + np.floor(np.abs(2 * x.astype(np.float64)))
    err_ulps = np.abs(got - want) / ulp
    assert np.all(err_ulps <= bound + 1.5), float(np.max(err_ulps - bound))  # + rounding
    assert np.mean(err_ulps > 2) > 0.5  # the error model is on
    assert np.any(got > want) and np.any(got < want)  # both directions
