"""Single-stream decode on the CPU: the layers as one op, a layer as one op or 5 ops, and
async scheduling, A/B.

    PYTHONPATH=. python bench/layer_ops.py [MODEL] [--rounds 5] [--tokens 64]
        [--forward-reps 60] [--kv-cache-dtype auto|int8] [--variants V ...]

One engine (default: the embedded SmolLM2-135M Q4_1), one greedy request at a time
(32-token prompt, ``--tokens`` decoded); the variants take turns round by round, so a
change in the machine's load hits them alike:

* ``stack``: today's model, every layer in one op (cpu/stack.decoder_stack);
* ``one op``: an op per layer (cpu/layer.decoder_layer; the stack switched off for
  the round);
* ``5 ops``: the layer's halves around the separate K/V write and attention (the stack and
  decoder_layer switched off);
* ``stack, async``: async scheduling (the engine's default): each ``step()`` builds the
  next step while the one in flight computes; the other variants run steps in the
  synchronous order (``LLMEngine.async_scheduling`` off).

Per variant: decode tok/s (tokens after the first over their wall time; median over the
rounds), the runner's graph build per step (``launch`` less its ``mx.async_eval``), the
time ``mx.async_eval`` blocked per step (MLX waits inside it while more than ~10 tasks
of the CPU stream are outstanding), the CPU time per token (every thread of the process)
and the steps the runner's PoolWatch saw copy a pool instead of writing it in place.

Then the forward pass alone (one decode row at a 40-token context: the model's graph
built and evaluated, no engine), the variants interleaved ``--forward-reps`` times:
best and median wall and CPU time. Best-of is the machine's quiet moments; the medians
carry the load.

The load average is printed before and after: the machine is shared, and a process whose
main thread waits (one op: MLX has the step's few ops queued at once) gets a smaller
share of a loaded machine than one whose main thread keeps dispatching. With
``MLXSERVE_CPU_THREADS=1`` the CPU time is the work a token costs whoever else runs.
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
from mlxserve.cpu import layer as cpu_layer  # noqa: E402
from mlxserve.cpu import stack as cpu_stack  # noqa: E402

VARIANTS = ("stack", "one op", "5 ops", "stack, async")
_OFF = {"stack": (), "one op": ("stack",), "5 ops": ("stack", "layer")}


def _switch(variant: str) -> None:
    """The parts ``variant`` runs without switched off (see the module docstring)."""
    off = _OFF[variant.split(",")[0]]
    cpu_stack.decoder_stack = _none if "stack" in off else _STACK
    cpu_layer.decoder_layer = _none if "layer" in off else _LAYER


def _none(*args, **kwargs) -> None:
    return None


_STACK, _LAYER = cpu_stack.decoder_stack, cpu_layer.decoder_layer


def run_round(engine, variant: str, prompt: list[int], tokens: int) -> dict[str, float]:
    """One request decoded under ``variant``; tok/s and per-step blocking in async_eval."""
    real_async_eval = mx.async_eval
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

    _switch(variant)
    was_async = engine.async_scheduling
    engine.async_scheduling = variant.endswith("async")
    mx.async_eval = timing(real_async_eval, "async_eval")
    runner.launch = timing(runner.launch, "launch")
    watch = engine.runner.pool_watch
    copied = watch.num_copied_steps
    cpu = time.process_time()
    try:
        r = timed_generate(engine, [prompt], tokens)
    finally:
        cpu = time.process_time() - cpu
        _switch("stack")
        mx.async_eval = real_async_eval
        del runner.launch  # the class's method again
        engine.async_scheduling = was_async
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


def forward_ab(engine, reps: int) -> None:
    """The model's forward pass alone, the variants interleaved; prints best/median."""
    from mlxserve.models import KVCache
    from mlxserve.ops import AttentionMetadata

    model = engine.runner.model
    cache = KVCache.allocate_for(model, 16, 16, engine.runner.kv_cache.keys[0].dtype)
    mx.eval(cache.arrays())
    md = AttentionMetadata.build([1], [40], [[1, 2, 3]], 16)
    ids, positions = mx.array([5], dtype=mx.int32), mx.array([39], dtype=mx.int32)
    times = {v: ([], []) for v in _OFF}
    for _ in range(reps):
        for variant, (wall, cpu) in times.items():
            _switch(variant)
            c, t = time.process_time(), time.perf_counter()
            try:
                mx.eval(model(ids, positions, md, cache, None), cache.arrays())
            finally:
                _switch("stack")
            wall.append((time.perf_counter() - t) * 1000)
            cpu.append((time.process_time() - c) * 1000)
    for variant, (wall, cpu) in times.items():
        print(
            f"forward pass, {variant:6s}: wall best {min(wall):.2f} / median"
            f" {statistics.median(wall):.2f} ms; CPU best {min(cpu):.2f} / median"
            f" {statistics.median(cpu):.2f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--forward-reps", type=int, default=60)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    engine = make_engine(args.model, kv_cache_dtype=args.kv_cache_dtype)
    prompts = make_prompts(engine.tokenizer, args.rounds * len(args.variants) + 1, 32)
    run_round(engine, "stack", prompts[-1], 8)  # warm up
    results: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    i = 0
    for _ in range(args.rounds):
        for variant in args.variants:
            results[variant].append(run_round(engine, variant, prompts[i], args.tokens))
            i += 1
    base_name = "5 ops" if "5 ops" in results else args.variants[0]
    base = statistics.median(r["tok_s"] for r in results[base_name])
    for variant, rows in results.items():
        tok_s = statistics.median(r["tok_s"] for r in rows)
        blocked = statistics.median(r["async_eval_ms"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        build = statistics.median(r["build_ms"] for r in rows)
        all_runs = " ".join(f"{r['tok_s']:.1f}" for r in rows)
        copied = sum(r["copied_steps"] for r in rows)
        print(
            f"{variant:20s} {tok_s:6.1f} tok/s ({tok_s / base:.2f}x {base_name};"
            f" runs {all_runs});"
            f" graph build {build:.2f} ms/step, then async_eval blocked {blocked:.2f};"
            f" CPU {cpu:.1f} ms/token;"
            f" steps that copied a pool {copied}"
        )
    if args.forward_reps:
        forward_ab(engine, args.forward_reps)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
