"""Single-stream decode on the CPU: a layer as one op vs 5 ops, and pipelined steps, A/B.

    PYTHONPATH=. python bench/layer_ops.py [MODEL] [--rounds 5] [--tokens 64]

One engine (default: the embedded SmolLM2-135M Q4_1), one greedy request at a time
(32-token prompt, ``--tokens`` decoded); the variants take turns round by round, so a
change in the machine's load hits them alike:

* ``one op``: today's layer (models/cpu_layer.decoder_layer);
* ``5 ops``: the layer's halves around the separate K/V write and attention (decoder_layer
  switched off for the round);
* ``one op, pipelined``: the engine launches step n+1 (its graph built) while step n
  computes, as on Metal (``LLMEngine.pipelined``).

Per variant: decode tok/s (tokens after the first over their wall time; median over the
rounds), the runner's graph build per step (``launch`` less its ``mx.async_eval``), the
time ``mx.async_eval`` blocked per step (MLX waits inside it while more than
~10 tasks of the CPU stream are outstanding), the CPU time per token and the steps the
runner's PoolWatch saw copy a pool instead of writing it in place. The load
average is printed before and after: the machine is shared. With ``MLXSERVE_CPU_THREADS=1``
the CPU time per token (every thread of the process) is the work a token costs whoever
else runs: the number to compare on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from mlxserve.cli.bench import make_engine, make_prompts, timed_generate  # noqa: E402
from mlxserve.models import cpu_layer  # noqa: E402

VARIANTS = ("one op", "5 ops", "one op, pipelined")


def run_round(engine, variant: str, prompt: list[int], tokens: int) -> dict[str, float]:
    """One request decoded under ``variant``; tok/s and per-step blocking in async_eval."""
    real_layer, real_async_eval = cpu_layer.decoder_layer, mx.async_eval
    runner = engine.runner
    timed = {"async_eval": [0.0, 0], "launch": [0.0, 0]}

    def timing(fn, name):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timed[name][0] += time.perf_counter() - t
                timed[name][1] += 1

        return call

    if variant == "5 ops":
        cpu_layer.decoder_layer = lambda *a, **k: None
    engine.pipelined = variant.endswith("pipelined")
    mx.async_eval = timing(real_async_eval, "async_eval")
    runner.launch = timing(runner.launch, "launch")
    watch = engine.runner.pool_watch
    copied = watch.num_copied_steps
    cpu = time.process_time()
    try:
        r = timed_generate(engine, [prompt], tokens)
    finally:
        cpu = time.process_time() - cpu
        cpu_layer.decoder_layer, mx.async_eval = real_layer, real_async_eval
        del runner.launch  # the class's method again
        engine.pipelined = False
    return {
        "tok_s": (tokens - 1) / (r["wall_s"] - r["first_token_s"]),
        "async_eval_ms": timed["async_eval"][0] / max(timed["async_eval"][1], 1) * 1000,
        # launch() is the graph build, then async_eval (blocking or not)
        "build_ms": (timed["launch"][0] - timed["async_eval"][0])
        / max(timed["launch"][1], 1)
        * 1000,
        "cpu_ms": cpu / tokens * 1000,
        "copied_steps": watch.num_copied_steps - copied,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    engine = make_engine(args.model)
    assert not engine.pipelined, "this compares the CPU path"
    prompts = make_prompts(engine.tokenizer, args.rounds * len(VARIANTS) + 1, 32)
    run_round(engine, "one op", prompts[-1], 8)  # warm up
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    i = 0
    for _ in range(args.rounds):
        for variant in VARIANTS:
            results[variant].append(run_round(engine, variant, prompts[i], args.tokens))
            i += 1
    base = statistics.median(r["tok_s"] for r in results["5 ops"])
    for variant, rows in results.items():
        tok_s = statistics.median(r["tok_s"] for r in rows)
        blocked = statistics.median(r["async_eval_ms"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        build = statistics.median(r["build_ms"] for r in rows)
        all_runs = " ".join(f"{r['tok_s']:.1f}" for r in rows)
        copied = sum(r["copied_steps"] for r in rows)
        print(
            f"{variant:20s} {tok_s:6.1f} tok/s ({tok_s / base:.2f}x 5 ops; runs {all_runs});"
            f" graph build {build:.2f} ms/step, then async_eval blocked {blocked:.2f};"
            f" CPU {cpu:.1f} ms/token;"
            f" steps that copied a pool {copied}"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
