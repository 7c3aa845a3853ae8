"""`mlxserve bench`: offline throughput of mlxserve alone (the peers live in bench/).

    single-stream decode   one request, DECODE tokens after a short prompt: tok/s of decode
    prefill                one PREFILL-token prompt, 1 output token: prompt tok/s (TTFT)
    batch N                N different prompts at once, BATCH_TOKENS each: output tok/s
    step profile           per-step wall time at batch N, split into host (Python) work
                           and time blocked waiting for MLX's evaluation

Every run uses greedy sampling with ignore_eos, so each request makes exactly its tokens.
Prompts are token ids (see :func:`make_prompts`), so peers can be fed the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASSAGE = (
    "The river starts high in the mountains, where snow melts in the spring and feeds small "
    "streams that join into one. It runs past farms and old stone bridges, through a town "
    "with a market on Saturdays, and on to the sea. Along the way it turns mills, waters "
    "fields, and carries boats loaded with wood, grain and wool. People have lived beside "
    "it for thousands of years, and many stories are told about its floods and its fish. "
)


@dataclass(frozen=True)
class OfflineSpec:
    """What to measure; defaults are the suite's (bench/README.md)."""

    prompt_tokens: int = 32  # prompts of the decode and batch runs
    decode_tokens: int = 128
    prefill_tokens: int = 512
    batch_sizes: tuple[int, ...] = (8, 32)
    batch_tokens: int = 32
    profile_batch: int = 32
    profile_steps: int = 16


@dataclass
class StepProfile:
    """Mean per-step times (ms) of a decode-only batch, and the host share."""

    batch: int
    step_ms: float
    host_ms: float  # Python: schedule, build the graph, read back, detokenize
    wait_ms: float  # blocked in MLX: collect() and inside mx.async_eval
    host_share: float
    parts_ms: dict[str, float] = field(default_factory=dict)


def device_info() -> dict[str, object]:
    """Where the numbers come from: machine, MLX device and version, BLAS, CPU kernels."""
    import mlx.core as mx

    from mlxserve.cpu import blas, kernels
    from mlxserve.utils import uses_gpu

    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal": bool(mx.metal.is_available()),
        "blas": blas.blas_status(),
        # Built on first use; only meaningful (and only consulted by the loader) on the CPU.
        "cpu_kernels": None if uses_gpu() else kernels.status(),
    }


def make_prompts(tokenizer, count: int, num_tokens: int, start: int = 0) -> list[list[int]]:
    """``count`` prompts of exactly ``num_tokens`` ids; they differ from their first block.

    Each starts with its own number, so no two share a prefix-cache block.
    """
    body = tokenizer.encode(PASSAGE * (num_tokens // 40 + 2), add_special_tokens=False)
    out = []
    for i in range(start, start + count):
        head = tokenizer.encode(f"Note {i * 7919 % 100000}: ", add_special_tokens=False)
        ids = (head + body[i % 17 :])[:num_tokens]
        assert len(ids) == num_tokens, (len(ids), num_tokens)
        out.append(ids)
    return out


def _params(max_tokens: int):
    from mlxserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def timed_generate(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Run prompts to completion on ``engine``; wall time, first-token and end times."""
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", None, _params(max_tokens), prompt_token_ids=ids)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    end = time.perf_counter()
    return {
        "wall_s": end - t0,
        "first_token_s": min(first.values()) - t0,
        "last_first_token_s": max(first.values()) - t0,
        "output_tokens": tokens,
    }


def run_offline(engine, spec: OfflineSpec, log=print) -> dict[str, float]:
    """The offline numbers of one engine (see module docstring)."""
    tok = engine.tokenizer
    res: dict[str, float] = {}
    timed_generate(engine, make_prompts(tok, 2, spec.prompt_tokens, start=900), 8)  # warm up
    r = timed_generate(engine, make_prompts(tok, 1, spec.prompt_tokens), spec.decode_tokens)
    res["decode_tok_s"] = (spec.decode_tokens - 1) / (r["wall_s"] - r["first_token_s"])
    log(f"[mlxserve] single-stream decode: {res['decode_tok_s']:.1f} tok/s")
    r = timed_generate(engine, make_prompts(tok, 1, spec.prefill_tokens, start=500), 1)
    res["prefill_tok_s"] = spec.prefill_tokens / r["first_token_s"]
    log(f"[mlxserve] prefill {spec.prefill_tokens}: {res['prefill_tok_s']:.1f} tok/s")
    for n in spec.batch_sizes:
        prompts = make_prompts(tok, n, spec.prompt_tokens, start=1000 * n)
        r = timed_generate(engine, prompts, spec.batch_tokens)
        res[f"batch{n}_tok_s"] = r["output_tokens"] / r["wall_s"]
        log(f"[mlxserve] batch {n} x {spec.batch_tokens}: {res[f'batch{n}_tok_s']:.1f} tok/s")
    return res


def profile_steps(engine, batch: int, num_steps: int, prompt_tokens: int = 32) -> StepProfile:
    """Time the parts of decode-only steps at ``batch`` requests (needs warm engine)."""
    import mlx.core as mx

    async_eval = mx.async_eval
    prompts = make_prompts(engine.tokenizer, batch, prompt_tokens, start=50_000)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", None, _params(num_steps + 8), prompt_token_ids=ids)
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


def make_engine(model: str | None, **engine_args):
    from mlxserve.config import EngineConfig
    from mlxserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **engine_args))


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` on the mlxserve command line."""
    p = subparsers.add_parser(
        "bench",
        help="offline throughput of mlxserve alone (the side-by-side suite is bench/)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL")
    d = OfflineSpec()
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens)
    p.add_argument("--batch-sizes", type=int, nargs="*", default=list(d.batch_sizes))
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--profile-batch", type=int, default=d.profile_batch, help="0: no profile")
    p.add_argument("--profile-steps", type=int, default=d.profile_steps)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's async scheduling (as `serve`'s flag)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(handler=bench_command)


def check_bench_flags(args: argparse.Namespace) -> None:
    """Every count a flag gives, checked before the model loads (one clear error line)."""

    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"

    for name in ("prompt_tokens", "decode_tokens", "prefill_tokens", "batch_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    bad = [n for n in args.batch_sizes if n < 1]
    if bad:
        raise ValueError(f"--batch-sizes must all be >= 1, got {bad[0]}")
    if args.profile_batch < 0:
        raise ValueError(f"--profile-batch must be >= 0 (0: no profile), got {args.profile_batch}")
    if args.profile_batch and args.profile_steps < 1:
        raise ValueError(
            f"--profile-steps must be >= 1 (or --profile-batch 0 for no profile), "
            f"got {args.profile_steps}"
        )


def bench_command(args: argparse.Namespace) -> int:
    check_bench_flags(args)
    spec = OfflineSpec(
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        prefill_tokens=args.prefill_tokens,
        batch_sizes=tuple(args.batch_sizes),
        batch_tokens=args.batch_tokens,
        profile_batch=args.profile_batch,
        profile_steps=args.profile_steps,
    )
    extra = {"async_scheduling": args.async_scheduling}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    need = max(spec.batch_sizes + (spec.profile_batch, 1))
    engine = make_engine(args.model, max_num_seqs=max(need, 64), **extra)
    info = device_info()
    print(f"device: {info['device']} ({info['platform']}, mlx {info['mlx']}); {info['blas']}")
    if info["cpu_kernels"]:
        print(info["cpu_kernels"])
    results: dict[str, object] = {"device": info, "spec": asdict(spec)}
    results["offline"] = run_offline(engine, spec)
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
    return 0
