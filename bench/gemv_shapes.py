"""One decode step's quantized matmuls at one row, per shape, through MLX (issue 18).

    PYTHONPATH=. python bench/gemv_shapes.py [--threads 1 2] [--acts float int8]
        [--rounds 5] [--spin-us 200 0] [--claim-div 0 2] [--same-weights]

Each shape gets as many distinct weight matrices as a SmolLM2-135M step uses (30 layers of
fused q/k/v 576 -> 960, o 576 -> 576, fused gate/up 576 -> 3072, down 1536 -> 576: 4-bit;
one tied 576 -> 49152 LM head: 8-bit; group 32, float16 scales, as the default model
loads), and one ``mx.eval`` runs all of them back to back, as a step does: the weights
stream from the cache levels they would in a step (``--same-weights``: one matrix called
30 times, which stays in L2, as a loop over one matrix does), and the kernels' thread
pool sees calls back to back, as inside the fused layer ops.

Prints microseconds per call (best of ``--rounds`` evals: wall time, and this process's
CPU time, which a busy machine disturbs less but which counts the workers' spinning with
2 threads) and billions of weights per second, for every combination of threads,
activations and the pool's settings (``--spin-us``: how long its workers spin for the next
call before sleeping; ``--claim-div``: how many items a claim takes, qmm.h), the
combinations interleaved round by round in one process, so a load change hits them all.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from bench.q8_gemv import SHAPES  # name: (K, N, bits, calls per step)
from mlxserve.cpu import kernels as cpu


def weights(k: int, n: int, bits: int, count: int, seed: int) -> list[tuple[mx.array, ...]]:
    """``count`` quantized (w, scales, biases) of shape (n, k), float16 scales."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        wq, s, b = mx.quantize(w, group_size=32, bits=bits)
        out.append((wq, s.astype(mx.float16), b.astype(mx.float16)))
    mx.eval(out)
    return out


def step(x: mx.array, mats: list[tuple[mx.array, ...]], bits: int, act_bits: int) -> list:
    """All of a shape's matmuls on one input (MLX runs them back to back, nothing between)."""
    return [cpu.quantized_matmul(x, wq, s, b, 32, bits, act_bits) for wq, s, b in mats]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--acts", nargs="+", default=["float", "int8"], choices=["float", "int8"])
    ap.add_argument("--spin-us", type=int, nargs="+", default=[None], help="pool spin windows")
    ap.add_argument(
        "--claim-div",
        type=int,
        nargs="+",
        default=[None],
        help="pool claims: (items left) / (div * threads) items at once; 0: one (qmm.h)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument(
        "--same-weights",
        dest="distinct",
        action="store_false",
        help="one matrix per shape called 30 times (stays in L2) instead of 30 distinct",
    )
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    if not cpu.available():
        raise SystemExit(cpu.status())
    module = cpu.module()
    default_spin = module.spin_us()
    spins = [default_spin if s is None else s for s in args.spin_us]
    default_div = module.set_claim_div(-1)
    claim_divs = [default_div if d is None else d for d in args.claim_div]
    print(f"float {module.isa()}, int8 {module.q8_isa()}; spin {spins} us, claim-div {claim_divs}")
    data = {
        name: weights(*SHAPES[name][:3], SHAPES[name][3] if args.distinct else 1, i)
        * (1 if args.distinct else SHAPES[name][3])
        for i, name in enumerate(args.shapes)
    }
    rng = np.random.default_rng(9)
    combos = [
        (t, a, s, cd) for t in args.threads for a in args.acts for s in spins for cd in claim_divs
    ]
    best: dict[tuple, float] = {}
    best_cpu: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for name in args.shapes:
            k, n, bits, count = SHAPES[name]
            x = mx.array(rng.standard_normal((1, k)).astype(np.float32))
            for threads, acts, spin, cd in combos:
                module.set_threads(threads)
                module.set_claim_div(cd)
                module.set_spin_us(spin)
                y = step(x, data[name], bits, 8 if acts == "int8" else 0)
                mx.eval(y)  # warm: the pool started, scratch grown
                y = step(x, data[name], bits, 8 if acts == "int8" else 0)
                t, c = time.perf_counter(), time.process_time()
                mx.eval(y)
                us = (time.perf_counter() - t) * 1e6 / count
                cpu_us = (time.process_time() - c) * 1e6 / count
                key = (name, threads, acts, spin, cd)
                best[key] = min(best.get(key, float("inf")), us)
                best_cpu[key] = min(best_cpu.get(key, float("inf")), cpu_us)
    module.set_threads(0)
    module.set_claim_div(default_div)
    module.set_spin_us(default_spin)
    out = {}
    for threads, acts, spin, cd in combos:
        total = total_cpu = 0.0
        for name in args.shapes:
            k, n, bits, count = SHAPES[name]
            us, cpu_us = (
                best[(name, threads, acts, spin, cd)],
                best_cpu[(name, threads, acts, spin, cd)],
            )
            total += us * count
            total_cpu += cpu_us * count
            label = f"{threads}t {acts:5s} spin {spin} claim-div {cd}"
            print(
                f"{label}  {name:8s} {k:5d}x{n:<6d} {us:8.1f} us/call  "
                f"{k * n / us / 1e3:6.2f} G weights/s  (CPU {cpu_us:8.1f} us)"
            )
            out[f"{label} {name}"] = {"us": us, "cpu_us": cpu_us}
        print(f"{label}  step total {total / 1000:.2f} ms (CPU {total_cpu / 1000:.2f} ms)")
        out[f"{label} total_ms"] = {"ms": total / 1000, "cpu_ms": total_cpu / 1000}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
