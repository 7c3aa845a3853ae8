"""Serving latency: mlxserve vs mlx-lm's server on the same weights, same prompts, one run.

    PYTHONPATH=. python bench/serve_latency.py                    # embedded SmolLM2 GGUF
    PYTHONPATH=. python bench/serve_latency.py MODEL --num-clients 8 --max-tokens 64

Starts `mlxserve serve MODEL` and `mlx_lm server --model DIR` (DIR: MODEL exported by
`mlxserve convert` when it is a .gguf) one after the other on free localhost ports. N
clients each send their requests one after another (closed loop), streaming, greedy,
every request a different prompt. Per server: TTFT, TPOT, ITL (p50 / p99) and output
tokens/s; then the ratios mlx-lm / mlxserve (> 1: mlxserve is faster, for tok/s the
inverse).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOPICS = [
    "the history of the bicycle",
    "how volcanoes form",
    "why the sky is blue",
    "the life cycle of a butterfly",
    "how a refrigerator works",
    "the rules of chess",
    "the water cycle",
    "how bread is baked",
    "the planets of the solar system",
    "how bees make honey",
    "the causes of the seasons",
    "how a compass works",
    "the invention of the printing press",
    "how rainbows appear",
    "the migration of birds",
    "how a battery stores energy",
]


def make_prompt(i: int) -> str:
    """Prompt i (~30 tokens); prompts differ from their first token, so no server gets
    prefix-cache hits between them."""
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"{topic[0].upper()}{topic[1:]} (part {i + 1}): a short article for curious "
        f"students that explains the main ideas step by step.\n\n"
    )


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    num_tokens: int
    itls: list[float] = field(default_factory=list)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: Path, health: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise TimeoutError(f"{cmd[:4]} not ready:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    sent = time.perf_counter()
    times: list[float] = []
    num_tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    done = time.perf_counter()
    if not times:
        raise RuntimeError(f"no text streamed for {body['prompt'][:40]!r}")
    return RequestResult(
        ttft=times[0] - sent,
        e2e=done - sent,
        num_tokens=num_tokens if num_tokens is not None else len(times),
        itls=np.diff(times).tolist(),
    )


async def run_load(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=args.num_clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        base = {"max_tokens": args.max_tokens, "temperature": 0.0, "stream": True}
        base["stream_options"] = {"include_usage": True}
        await one_request(client, base | {"prompt": "Warm up.", "max_tokens": 4})

        async def worker(c: int) -> list[RequestResult]:
            out = []
            for r in range(args.requests_per_client):
                prompt = make_prompt(c * args.requests_per_client + r)
                out.append(await one_request(client, base | {"prompt": prompt}))
            return out

        start_time = time.perf_counter()
        per_client = await asyncio.gather(*(worker(c) for c in range(args.num_clients)))
        wall = time.perf_counter() - start_time
    return [r for rs in per_client for r in rs], wall


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    ttft = np.array([r.ttft for r in results]) * 1000
    tpot = np.array([(r.e2e - r.ttft) / (r.num_tokens - 1) for r in results if r.num_tokens > 1])
    itl = np.array([x for r in results for x in r.itls]) * 1000
    total = sum(r.num_tokens for r in results)
    return {
        "requests": len(results),
        "output_tokens": total,
        "wall_s": wall,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "tpot_p50_ms": float(np.percentile(tpot * 1000, 50)),
        "tpot_p99_ms": float(np.percentile(tpot * 1000, 99)),
        "itl_p50_ms": float(np.percentile(itl, 50)),
        "itl_p99_ms": float(np.percentile(itl, 99)),
        "output_tok_s": total / wall,
    }


def bench_server(name: str, cmd: list[str], health: str, args, logs: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"[{name}] starting: {' '.join(cmd + ['--port', str(port)])}", flush=True)
    proc = start(cmd + ["--port", str(port)], url, logs / f"{name}.log", health)
    try:
        results, wall = asyncio.run(run_load(url, args))
    finally:
        stop(proc)
    summary = summarize(results, wall)
    print(f"[{name}] {json.dumps({k: round(v, 2) for k, v in summary.items()})}", flush=True)
    return summary


def run_both(args: argparse.Namespace, source, work: Path, convert) -> dict[str, dict]:
    """Bench mlxserve, then mlx-lm (on ``source`` exported into ``work`` if needed)."""
    results: dict[str, dict] = {}
    if args.only != "mlx-lm":
        cmd = [sys.executable, "-m", "mlxserve.cli", "serve", str(source.path)]
        cmd += ["--disable-log-stats", "--uvicorn-log-level", "warning"]
        results["mlxserve"] = bench_server("mlxserve", cmd, "/health", args, work)
    if args.only != "mlxserve":
        mlx_dir = args.mlx_lm_model
        if mlx_dir is None:
            mlx_dir = source.path if source.kind == "dir" else convert(args.model, work / "mlx")
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_dir)]
        cmd += ["--log-level", "WARNING"]
        results["mlx-lm"] = bench_server("mlx-lm", cmd, "/health", args, work)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--mlx-lm-model", default=None, help="mlx-lm directory (default: converted)")
    p.add_argument("--num-clients", type=int, default=4)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--only", choices=["mlxserve", "mlx-lm"], default=None)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    from mlxserve.convert import convert
    from mlxserve.loader import resolve_model

    source = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="serve-latency-") as tmp:
        results = run_both(args, source, Path(tmp), convert)

    print(
        f"\nmodel {source.name}; {args.num_clients} clients x {args.requests_per_client} "
        f"requests, max_tokens {args.max_tokens}, greedy, streaming /v1/completions\n"
    )
    keys = [k for k in next(iter(results.values())) if k not in ("requests", "wall_s")]
    both = len(results) == 2
    header = f"{'metric':<16}" + "".join(f"{n:>12}" for n in results)
    print(header + (f"{'ratio':>10}" if both else ""))
    for k in keys:
        row = f"{k:<16}" + "".join(f"{r[k]:>12.1f}" for r in results.values())
        if both:
            ours, theirs = results["mlxserve"][k], results["mlx-lm"][k]
            ratio = ours / theirs if k.startswith("output") else theirs / ours
            row += f"{ratio:>10.2f}"
        print(row)
    if both:
        print("\nratio: mlx-lm / mlxserve for latencies, mlxserve / mlx-lm for tokens and tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
