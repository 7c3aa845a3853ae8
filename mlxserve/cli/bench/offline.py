"""mlxserve's engine alone, no server: `mlxserve bench [MODEL]`, `latency`, `throughput`.

    single-stream decode   one request, DECODE tokens after a short prompt: tok/s of decode
    prefill                one PREFILL-token prompt, 1 output token: prompt tok/s (TTFT)
    batch N                N different prompts at once, BATCH_TOKENS each: output tok/s
    step profile           per-step wall time at batch N, split into host (Python) work
                           and time blocked waiting for MLX's evaluation

`mlxserve bench [MODEL]` (no sub-command) runs all four, the quick check; `latency` the
first two, `throughput` the batches (and the step profile when --profile-batch is given).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlxserve.cli.bench.workload import (
    OfflineSpec,
    conditions,
    device_info,
    greedy,
    make_engine,
    make_prompts,
    timed_generate,
)

# Which flags each run takes, and so which parts of OfflineSpec it measures.
LATENCY_FLAGS = ("prompt_tokens", "decode_tokens", "prefill_tokens")
THROUGHPUT_FLAGS = (
    "prompt_tokens",
    "batch_sizes",
    "batch_tokens",
    "profile_batch",
    "profile_steps",
)
QUICK_FLAGS = tuple(dict.fromkeys(LATENCY_FLAGS + THROUGHPUT_FLAGS))


@dataclass
class StepProfile:
    """Mean per-step times (ms) of a decode-only batch, and the host share."""

    batch: int
    step_ms: float
    host_ms: float  # Python: schedule, build the graph, read back, detokenize
    wait_ms: float  # blocked in MLX: collect() and inside mx.async_eval
    host_share: float
    parts_ms: dict[str, float] = field(default_factory=dict)


def warm_up(engine: Any, spec: OfflineSpec) -> None:
    """Two short requests first, so no measurement pays for compiling or growing buffers."""
    timed_generate(engine, make_prompts(engine.tokenizer, 2, spec.prompt_tokens, start=900), 8)


def measure_latency(engine: Any, spec: OfflineSpec, log: Callable = print) -> dict[str, float]:
    """Single-stream decode tok/s and prefill tok/s (a warm engine)."""
    tok = engine.tokenizer
    res: dict[str, float] = {}
    r = timed_generate(engine, make_prompts(tok, 1, spec.prompt_tokens), spec.decode_tokens)
    res["decode_tok_s"] = (spec.decode_tokens - 1) / (r["wall_s"] - r["first_token_s"])
    log(f"[mlxserve] single-stream decode: {res['decode_tok_s']:.1f} tok/s")
    r = timed_generate(engine, make_prompts(tok, 1, spec.prefill_tokens, start=500), 1)
    res["prefill_tok_s"] = spec.prefill_tokens / r["first_token_s"]
    log(f"[mlxserve] prefill {spec.prefill_tokens}: {res['prefill_tok_s']:.1f} tok/s")
    return res


def measure_throughput(engine: Any, spec: OfflineSpec, log: Callable = print) -> dict[str, float]:
    """Output tok/s of each batch of ``spec.batch_sizes`` prompts (a warm engine)."""
    res: dict[str, float] = {}
    for n in spec.batch_sizes:
        prompts = make_prompts(engine.tokenizer, n, spec.prompt_tokens, start=1000 * n)
        r = timed_generate(engine, prompts, spec.batch_tokens)
        res[f"batch{n}_tok_s"] = r["output_tokens"] / r["wall_s"]
        log(f"[mlxserve] batch {n} x {spec.batch_tokens}: {res[f'batch{n}_tok_s']:.1f} tok/s")
    return res


def run_offline(engine: Any, spec: OfflineSpec, log: Callable = print) -> dict[str, float]:
    """The offline numbers of one engine (see module docstring)."""
    warm_up(engine, spec)
    return measure_latency(engine, spec, log) | measure_throughput(engine, spec, log)


def profile_steps(engine: Any, batch: int, num_steps: int, prompt_tokens: int = 32) -> StepProfile:
    """Time the parts of decode-only steps at ``batch`` requests (needs warm engine)."""
    import mlx.core as mx

    async_eval = mx.async_eval
    prompts = make_prompts(engine.tokenizer, batch, prompt_tokens, start=50_000)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", None, greedy(num_steps + 8), prompt_token_ids=ids)
    while engine.scheduler.waiting or any(  # prefill everything first: decode steps only
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    parts = {"launch": 0.0, "collect": 0.0, "schedule": 0.0, "update": 0.0, "process": 0.0}
    # MLX's async_eval blocks while too many tasks are outstanding on the CPU stream, so
    # the time inside it is waiting too (a part of "launch" that is not host work).
    parts["async_eval"] = 0.0
    wrapped = {
        "launch": (engine.runner, "launch"),
        "collect": (engine.runner, "collect"),
        "schedule": (engine.scheduler, "schedule"),
        "update": (engine.scheduler, "update_from_output"),
        "process": (engine, "_process"),
        "async_eval": (mx, "async_eval"),
    }
    originals = {}
    for name, (obj, attr) in wrapped.items():
        fn = getattr(obj, attr)
        originals[name] = (obj, attr)

        def timed(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                parts[_name] += time.perf_counter() - t

        setattr(obj, attr, timed)
    try:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - t0
    finally:
        for obj, attr in originals.values():
            if obj is mx:
                setattr(mx, attr, async_eval)
            else:
                delattr(obj, attr)  # back to the class's method
    engine.abort_request([f"p{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    # collect() is almost all waiting: its host part (tolist of a few ints) is tiny.
    wait = parts["collect"] + parts["async_eval"]
    host = wall - wait
    ms = {k: v / num_steps * 1000 for k, v in parts.items()}
    return StepProfile(
        batch=batch,
        step_ms=wall / num_steps * 1000,
        host_ms=host / num_steps * 1000,
        wait_ms=wait / num_steps * 1000,
        host_share=host / wall,
        parts_ms=ms,
    )


def add_offline_flags(p: argparse.ArgumentParser, names: tuple[str, ...], model: bool) -> None:
    """MODEL (when ``model``), the OfflineSpec flags ``names``, the engine flags and outputs."""
    if model:
        p.add_argument("model", nargs="?", default=None, metavar="MODEL")
    d = OfflineSpec()
    flags: dict[str, dict[str, Any]] = {
        "prompt_tokens": {"type": int, "default": d.prompt_tokens},
        "decode_tokens": {"type": int, "default": d.decode_tokens},
        "prefill_tokens": {"type": int, "default": d.prefill_tokens},
        "batch_sizes": {"type": int, "nargs": "*", "default": list(d.batch_sizes)},
        "batch_tokens": {"type": int, "default": d.batch_tokens},
        "profile_batch": {"type": int, "default": d.profile_batch, "help": "0: no profile"},
        "profile_steps": {"type": int, "default": d.profile_steps},
    }
    if "profile_batch" in names and names != QUICK_FLAGS:  # `throughput`: asked for only
        flags["profile_batch"] = {**flags["profile_batch"], "default": 0}
    for name in names:
        p.add_argument(f"--{name.replace('_', '-')}", **flags[name])
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's async scheduling (as `serve`'s flag)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--out", default=None, help="write results.json and chart.png in this folder")


def offline_spec(args: argparse.Namespace, names: tuple[str, ...]) -> OfflineSpec:
    """The OfflineSpec of flags ``names`` (the run's own: `bench`'s flags before a
    sub-command are not its), each count checked before the model loads."""

    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"

    given = {name: getattr(args, name) for name in names}
    for name in ("prompt_tokens", "decode_tokens", "prefill_tokens", "batch_tokens"):
        if given.get(name, 1) < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {given[name]}")
    bad = [n for n in given.get("batch_sizes", []) if n < 1]
    if bad:
        raise ValueError(f"--batch-sizes must all be >= 1, got {bad[0]}")
    profile_batch = given.get("profile_batch", 0)
    if profile_batch < 0:
        raise ValueError(f"--profile-batch must be >= 0 (0: no profile), got {profile_batch}")
    if profile_batch and given["profile_steps"] < 1:
        raise ValueError(
            f"--profile-steps must be >= 1 (or --profile-batch 0 for no profile), "
            f"got {given['profile_steps']}"
        )
    given["batch_sizes"] = tuple(given.get("batch_sizes", ()))
    return OfflineSpec(**{"profile_batch": 0, **given})


def offline_command(
    args: argparse.Namespace, parts: tuple[str, ...], names: tuple[str, ...]
) -> int:
    """Measure ``parts`` (of "latency", "throughput") on one engine, with the OfflineSpec
    flags ``names``; print the report."""
    from mlxserve.cli.bench import report

    spec = offline_spec(args, names)
    extra = {"async_scheduling": args.async_scheduling}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    need = max(spec.batch_sizes + (spec.profile_batch, 1))
    engine = make_engine(args.model, max_num_seqs=max(need, 64), **extra)
    info = device_info()
    print(f"device: {info['device']} ({info['platform']}, mlx {info['mlx']}); {info['blas']}")
    if info["cpu_kernels"]:
        print(info["cpu_kernels"])
    results: dict[str, Any] = {"device": info, "spec": asdict(spec)}
    warm_up(engine, spec)
    offline: dict[str, float] = {}
    if "latency" in parts:
        offline |= measure_latency(engine, spec)
    if "throughput" in parts:
        offline |= measure_throughput(engine, spec)
    results["offline"] = offline
    if spec.profile_batch:
        prof = profile_steps(engine, spec.profile_batch, spec.profile_steps)
        overlap = engine.async_scheduling
        results["profile"] = asdict(prof)
        print(
            f"[mlxserve] step at batch {prof.batch}: {prof.step_ms:.1f} ms, host (Python) "
            f"{prof.host_ms:.1f} ms = {prof.host_share:.0%}, waiting for MLX {prof.wait_ms:.1f} ms"
            + (" (async scheduling: the host work runs while a step computes)" if overlap else "")
        )
        print("  " + ", ".join(f"{k} {v:.1f} ms" for k, v in prof.parts_ms.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    # The report's shape is the suite's: numbers per engine, here one.
    shown = {
        "model": engine.model_name,
        "device": info,
        "conditions": conditions(),
        "spec": asdict(spec),
    }
    shown["offline"] = {"mlxserve": offline}
    if "profile" in results:
        shown["profile"] = {"mlxserve": results["profile"]}
    report.publish(shown, Path(args.out) if args.out else None)
    return 0
