"""The CPU kernels' matmuls alone: float activations vs int8 activations, per ISA.

    PYTHONPATH=. python bench/q8_gemv.py [--rows 1 8 32 128 512] [--threads 1] [--calls 200]
        [--cpu-time]

Calls the built kernels' C entry point (``mlxserve_qmm``, through ctypes on the cached
extension) in a loop, without MLX in between, on SmolLM2-135M's decode shapes (fused
q/k/v 576 -> 960, o 576 -> 576, fused gate/up 576 -> 3072, down 1536 -> 576: 4-bit; the
tied LM head 576 -> 49152: 8-bit; group 32, float16 scales, as the default model loads).
Prints microseconds per call (best of 5 runs of ``--calls`` calls, wall time; with
``--cpu-time`` this process's CPU time, which a busy machine disturbs far less) for the
float path and each int8 instruction set this CPU has, and the per-token sum (30 layers
of the four projections plus the head; for M rows, the sum for all M). Decode rows are
M = 1-8; batches and prompt chunks run the same kernels with more rows. Kernel time is
far less sensitive to a loaded machine than end-to-end tok/s: with ``--threads 1`` one
core does all the work.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import mlx.core as mx
import numpy as np

from mlxserve.cpu import kernels as cpu

SHAPES = {  # name: (K, N, bits, calls per token)
    "qkv": (576, 960, 4, 30),
    "o": (576, 576, 4, 30),
    "gate_up": (576, 3072, 4, 30),
    "down": (1536, 576, 4, 30),
    "lm_head": (576, 49152, 8, 1),
}
F16 = 1  # QMM_F16 (qmm.h)


class Problem(ctypes.Structure):
    """qmm.h's qmm_problem."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("biases", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("M", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("group_size", ctypes.c_int),
        ("bits", ctypes.c_int),
        ("scale_type", ctypes.c_int),
        ("act_bits", ctypes.c_int),
    ]


def arrays(k: int, n: int, bits: int, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    wq, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    return {
        "x": rng.standard_normal((rows, k)).astype(np.float32),
        "w": np.array(wq),
        "scales": np.array(scales.astype(mx.float16)),
        "biases": np.array(biases.astype(mx.float16)),
        "y": np.zeros((rows, n), np.float32),
    }


def time_call(
    lib, a: dict[str, np.ndarray], bits: int, act_bits: int, calls: int, clock=time.perf_counter
) -> float:
    rows, k = a["x"].shape
    p = Problem(
        *(a[name].ctypes.data for name in ("x", "w", "scales", "biases", "y")),
        rows,
        a["y"].shape[1],
        k,
        32,
        bits,
        F16,
        act_bits,
    )
    ref = ctypes.byref(p)
    if lib.mlxserve_qmm(ref) != 0:
        raise RuntimeError("unsupported problem")
    best = float("inf")
    for _ in range(5):
        t = clock()
        for _ in range(calls):
            lib.mlxserve_qmm(ref)
        best = min(best, (clock() - t) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1, help="0: the kernels' default")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--cpu-time", action="store_true", help="time by CPU time, not wall time")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    if not cpu.available():
        raise SystemExit(cpu.status())
    module = cpu._module()
    module.set_threads(args.threads)
    lib = ctypes.CDLL(str(cpu.info()["path"]))
    isas = [i for i in ("avx512vnni", "avxvnni", "avx2", "neon", "scalar")]
    isas = [i for i in isas if module.q8_isa_supported(i)]
    print(f"float path: {module.isa()}; int8 paths: {', '.join(isas)}; threads {module.threads()}")
    out: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        totals: dict[str, float] = {}
        for name, (k, n, bits, per_token) in SHAPES.items():
            a = arrays(k, n, bits, rows)
            calls = max(3, args.calls * 576 * 960 // (k * n * rows))
            clock = time.process_time if args.cpu_time else time.perf_counter
            res = {"float": time_call(lib, a, bits, 0, calls, clock)}
            for isa in isas:
                module.q8_force_isa(isa)
                res[f"int8 {isa}"] = time_call(lib, a, bits, 8, calls, clock)
            module.q8_force_isa("auto")
            for key, us in res.items():
                totals[key] = totals.get(key, 0.0) + us * per_token
            out[f"{rows}x{name}"] = res
            cells = "  ".join(f"{key} {us:8.1f}" for key, us in res.items())
            print(f"M={rows} {name:8s} {k:5d}x{n:<6d} {bits}-bit  us/call: {cells}")
        out[f"{rows}xtoken"] = totals
        cells = "  ".join(f"{key} {us / 1000:6.2f}" for key, us in totals.items())
        print(f"M={rows} per token (30 layers + head), ms: {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
