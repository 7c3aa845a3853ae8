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


MMA = """
  const uint lane = thread_index_in_simdgroup;
  simdgroup_float8x8 a;
  simdgroup_float8x8 b;
  simdgroup_float8x8 c;
  simdgroup_load(a, x, 16);        // rows of 16: the left 8x8 of a 8x16 matrix
  simdgroup_load(b, x + 8, 16);    // its right half
  simdgroup_load(c, x + 128);      // a plain 8x8 after it
  simdgroup_float8x8 d;
  simdgroup_multiply_accumulate(d, a, b, c);
  simdgroup_float8x8 e;
  simdgroup_multiply(e, d, a);
  threadgroup float tg[64];
  simdgroup_store(e, tg);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = tg[63 - lane];        // lanes read elements other lanes stored
  out[32 + lane] = tg[31 - lane];
  simdgroup_store(d, out + 64, 8);
"""


def test_simdgroup_matrix_ops_match_numpy() -> None:
    """Loads with a row stride, multiply-accumulate, multiply, stores to threadgroup and
    device memory: one simdgroup's 8x8 tiles against numpy."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(192).astype(np.float32)
    out = _run(MMA, x, (128,), 32)
    m = x[:128].reshape(8, 16)
    a, b, c = m[:, :8], m[:, 8:], x[128:].reshape(8, 8)
    d = a.astype(np.float64) @ b + c
    e = (d @ a).reshape(-1)
    np.testing.assert_allclose(out[:64], np.concatenate([e[::-1][:32], e[31::-1]]), rtol=1e-5)
    np.testing.assert_allclose(out[64:].reshape(8, 8), d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "old,new,what",
    [
        ("simdgroup_barrier(mem_flags::mem_threadgroup);\n", "", "race"),  # store -> lanes read
        (
            "const uint lane = thread_index_in_simdgroup;\n",
            "const uint lane = thread_index_in_simdgroup;\n  if (lane == 5) { return; }\n",
            "divergence",  # the lanes left wait at the barrier for lane 5
        ),
        (
            "simdgroup_store(e, tg);\n  simdgroup_barrier(mem_flags::mem_threadgroup);\n",
            "if (lane == 5) { return; }\n",
            "nan",  # a missing lane: every lane's matrix result is undefined
        ),
    ],
)
def test_simdgroup_matrix_misuse_is_caught(old, new, what) -> None:
    from metal.checker.emulator import KernelError

    assert MMA.count(old) == 1
    emu = Emulator(schedules=("forward", "reverse"))
    k = emu.metal_kernel("shim_bad", ["x"], ["out"], MMA.replace(old, new))
    x = np.random.default_rng(0).standard_normal(192).astype(np.float32)
    args = dict(
        inputs=[mx.array(x)],
        output_shapes=[(128,)],
        output_dtypes=[mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )
    if what == "race":
        with pytest.raises(KernelError, match="differs between the forward and reverse"):
            k(**args)
    elif what == "divergence":
        with pytest.raises(KernelError, match="exited and never reach it"):
            k(**args)
    else:
        out = np.array(k(**args)[0])
        assert np.isnan(out[64:]).all()


def test_a_load_needs_a_barrier_after_lanes_write() -> None:
    """simdgroup_load reads when its lane arrives: data other lanes write just before needs a
    simdgroup_barrier, or the load sees the old contents (NaN here)."""
    src = """
      const uint lane = thread_index_in_simdgroup;
      threadgroup float tg[64];
      tg[2 * lane] = x[2 * lane];
      tg[2 * lane + 1] = x[2 * lane + 1];
      BARRIER
      simdgroup_float8x8 a;
      simdgroup_load(a, tg);
      simdgroup_store(a, out);
    """
    x = np.arange(64, dtype=np.float32)
    with_barrier = src.replace("BARRIER", "simdgroup_barrier(mem_flags::mem_threadgroup);")
    np.testing.assert_array_equal(_run(with_barrier, x, (64,), 32), x)
    assert np.isnan(_run(src.replace("BARRIER", ""), x, (64,), 32)).any()
