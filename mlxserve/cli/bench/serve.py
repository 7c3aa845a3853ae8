"""`mlxserve bench serve`: clients streaming from `mlxserve serve`, the suite's server workloads.

    serving   C clients in a closed loop (C = each --concurrency), distinct ~32-token
              prompts, --max-tokens each: TTFT, TPOT, ITL p50 / p99, output tok/s, and the
              server's CPU time per output token
    mixed     8 streams keep decoding while two long prompts arrive --long-gap s apart
    busy      --busy-streams streams keep decoding while 8 short prompts arrive 1 s apart
    prefix    6 requests one after another, a long shared system prompt and a short
              question: TTFT with prefix caching on and off

Each server runs alone (started on a free localhost port, measured, stopped); its resident
memory when ready and at its peak is recorded. `mlxserve bench peers` runs the same
workloads against mlx-lm's server and llama-server too (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from mlxserve.cli.bench.workload import (
    conditions,
    device_info,
    load_tokenizer,
    make_prompts,
    text_prompts,
)

if TYPE_CHECKING:
    from mlxserve.cli.bench.serving import RunningServer, Server, ServerSpec

SERVER_SECTIONS = ("serving", "mixed", "busy", "prefix")


def server_specs(args, gguf: Path, parallel: int, ctx_per_slot: int) -> dict[str, ServerSpec | str]:
    """The servers of ``args.peers``; llama-server with ``parallel`` slots of ``ctx_per_slot``.
    With ``args.base_url``, that one server, already running (named by its URL)."""
    from mlxserve.cli.bench import serving
    from mlxserve.cli.bench.common import STOCK_ENV
    from mlxserve.cli.bench.llamacpp import server_cmd

    if getattr(args, "base_url", None):
        return {args.base_url: args.base_url}
    specs = {}
    mlxserve_cmd = [sys.executable, "-m", "mlxserve.cli", "serve", str(gguf)]
    mlxserve_cmd += [
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        "--max-num-seqs",
        "64",
        "--kv-cache-disk-bytes",  # an earlier run's blocks of the same prompts are no hits
        "0",
    ]
    if args.max_num_batched_tokens:
        mlxserve_cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_async_scheduling:
        mlxserve_cmd += ["--no-async-scheduling"]
    mlxserve_cmd += getattr(args, "serve_args", None) or []
    if "mlxserve" in args.peers:
        specs["mlxserve"] = serving.ServerSpec("mlxserve", mlxserve_cmd)
    if "mlx-lm" in args.peers:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(args.mlx_dirs["q"])]
        specs["mlx-lm"] = serving.ServerSpec(
            "mlx-lm", cmd + ["--log-level", "WARNING"], env=STOCK_ENV
        )
    if "llama.cpp" in args.peers:
        cmd = server_cmd(gguf, args.threads, parallel, ctx_per_slot)
        specs["llama.cpp"] = serving.ServerSpec("llama.cpp", cmd)
    return specs


def open_server(spec: ServerSpec | str, work: Path) -> Server | RunningServer:
    """A context that starts the server of ``spec`` and stops it after; a URL: measured as
    it runs."""
    from mlxserve.cli.bench import serving

    if isinstance(spec, str):
        return serving.RunningServer(spec)
    return serving.Server(spec, work)


def note_rss(rss: dict[str, dict], name: str, srv: Server | RunningServer) -> None:
    """Record a stopped server's resident memory: when ready, and its peak."""
    rss[name] = {"ready_mib": srv.ready_rss_mib, "peak_mib": srv.peak_rss_mib}
    print(f"[{name}] RSS when ready {_mib(srv.ready_rss_mib)}, peak {_mib(srv.peak_rss_mib)}")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MiB"


def run_serving(args, tok, gguf: Path, work: Path, rss: dict[str, dict]) -> dict[str, dict]:
    from mlxserve.cli.bench import serving

    res: dict[str, dict] = {}
    for name, spec in server_specs(args, gguf, max(args.concurrency), 256).items():
        res[name] = {}
        with open_server(spec, work) as srv:
            for c in args.concurrency:
                per = max(1, args.requests // c) if c < args.requests else 1
                texts = text_prompts(tok, c * per, 32, start=10_000 + 100 * c)
                prompts = [texts[i * per : (i + 1) * per] for i in range(c)]
                cpu = serving.cpu_seconds(srv.proc.pid) if srv.proc else None
                results, wall = asyncio.run(serving.closed_loop(srv.url, prompts, args.max_tokens))
                res[name][str(c)] = s = serving.summarize(results, wall)
                if cpu is not None:  # the server's CPU time (all threads) per output token
                    used = serving.cpu_seconds(srv.proc.pid) - cpu
                    s["cpu_ms_per_token"] = 1000 * used / s["output_tokens"]
                brief = {k: round(v, 1) for k, v in s.items()}
                print(f"[{name}] concurrency {c}: {json.dumps(brief)}")
        note_rss(rss, name, srv)
    return res


def run_mixed(args, tok, gguf: Path, work: Path, rss: dict[str, dict]) -> dict[str, dict]:
    """8 streams keep decoding while two long prompts arrive args.long_gap s apart."""
    streams = text_prompts(tok, 8, 32, start=20_000)
    longs = text_prompts(tok, 2, args.long_prompt_tokens, start=21_000)
    return _under_load(args, gguf, work, rss, "mixed", streams, 900, longs, 4, args.long_gap, 1024)


def run_busy(args, tok, gguf: Path, work: Path, rss: dict[str, dict]) -> dict[str, dict]:
    """args.busy_streams streams keep decoding while 8 short prompts arrive 1 s apart."""
    streams = text_prompts(tok, args.busy_streams, 32, start=22_000)
    arrivals = text_prompts(tok, 8, 64, start=23_000)
    return _under_load(args, gguf, work, rss, "busy", streams, 256, arrivals, 4, 1.0, 512)


def _under_load(
    args,
    gguf: Path,
    work: Path,
    rss: dict[str, dict],
    label: str,
    streams: list[str],
    stream_tokens: int,
    arrivals: list[str],
    arrival_tokens: int,
    gap_s: float,
    ctx_per_slot: int,
) -> dict[str, dict]:
    from mlxserve.cli.bench import serving

    # Streams restart if they end (serving.BackgroundStreams), so stream_tokens only has to fit
    # llama-server's per-slot context (ctx_per_slot, with the prompt).
    res = {}
    slots = len(streams) + len(arrivals)
    for name, spec in server_specs(args, gguf, slots, ctx_per_slot).items():
        with open_server(spec, work) as srv:
            res[name] = asyncio.run(
                serving.under_load(srv.url, streams, stream_tokens, arrivals, arrival_tokens, gap_s)
            )
        note_rss(rss, name, srv)
        print(f"[{name}] {label}: {json.dumps({k: round(v, 2) for k, v in res[name].items()})}")
    return res


def run_prefix(args, tok, gguf: Path, work: Path, rss: dict[str, dict]) -> dict[str, dict]:
    from mlxserve.cli.bench import serving

    system = tok.decode(make_prompts(tok, 1, args.system_prompt_tokens, start=30_000)[0])
    questions = [f"\n\nQuestion {i}: what happens at step {i * 3 + 1}? Answer:" for i in range(6)]
    prompts = [system + q for q in questions]
    res = {}
    specs = server_specs(args, gguf, 4, 2048)
    if "mlxserve" in specs:
        off = specs["mlxserve"]
        specs["mlxserve (no prefix caching)"] = serving.ServerSpec(
            "mlxserve-nocache", [*off.cmd, "--no-enable-prefix-caching"]
        )
    for name, spec in specs.items():
        with open_server(spec, work) as srv:
            res[name] = asyncio.run(serving.shared_prefix(srv.url, prompts, 8))
        note_rss(rss, name, srv)
        print(
            f"[{name}] shared prefix: {json.dumps({k: round(v, 1) for k, v in res[name].items()})}"
        )
    return res


RUNNERS = {"serving": run_serving, "mixed": run_mixed, "busy": run_busy, "prefix": run_prefix}


def run_server_sections(
    args, tok, model_path: Path, work: Path, results: dict, sections: list[str], save
) -> None:
    """Run ``sections`` (of SERVER_SECTIONS) into ``results``; ``save()`` after each."""
    for section in sections:
        rss = results.setdefault("rss", {}).setdefault(section, {})
        results[section] = RUNNERS[section](args, tok, model_path, work, rss)
        save()


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server workloads' sizes and mlxserve serve's settings (`serve` and `peers`)."""
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument(
        "--requests", type=int, default=4, help="requests per concurrency level (at least)"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per serving request")
    p.add_argument("--long-prompt-tokens", type=int, default=512)
    p.add_argument("--long-gap", type=float, default=3.0, help="seconds between long prompts")
    p.add_argument(
        "--busy-streams", type=int, default=32, help="decoding streams of the busy section"
    )
    p.add_argument("--system-prompt-tokens", type=int, default=1024)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="mlxserve serve's step token budget (default: the server's)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="mlxserve (bench and serve) with async scheduling off",
    )
    p.add_argument("--out", default=None, help="results folder (default: a new temp folder)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument(
        "--workloads",
        default="serving",
        help="comma-separated, of " + ",".join(SERVER_SECTIONS) + " (default: serving)",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="measure this running OpenAI-compatible server (http://HOST:PORT) instead of "
        "starting `mlxserve serve MODEL`; MODEL's tokenizer still cuts the prompts",
    )
    p.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        help="one more `mlxserve serve` flag or value (repeatable: --serve-arg=--max-model-len "
        "--serve-arg=4096)",
    )
    add_server_flags(p)


def check_server_flags(args: argparse.Namespace, sections: list[str]) -> None:
    """Counts and names checked before anything starts (one clear error line)."""
    unknown = [s for s in sections if s not in SERVER_SECTIONS]
    if unknown:
        raise ValueError(f"--workloads: unknown {unknown[0]!r} (of {', '.join(SERVER_SECTIONS)})")
    for name in ("requests", "max_tokens", "long_prompt_tokens", "busy_streams"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if "serving" in sections and (not args.concurrency or min(args.concurrency) < 1):
        raise ValueError(f"--concurrency must be one or more counts >= 1, got {args.concurrency}")


def serve_command(args: argparse.Namespace) -> int:
    from mlxserve.cli.bench import report
    from mlxserve.loader import resolve_model

    sections = [s for s in args.workloads.split(",") if s]
    check_server_flags(args, sections)
    args.peers = ["mlxserve"]
    source = resolve_model(args.model)
    tok = load_tokenizer(str(source.path))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="mlxserve-bench-"))
    work = out_dir / "logs"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {
        # A server at --base-url serves what it serves; MODEL only tokenized the prompts.
        "model": args.base_url or source.name,
        "prompt_tokenizer": source.name,
        "device": device_info(),
        "conditions": conditions(),
        "args": {k: v for k, v in vars(args).items() if k != "handler"},
    }
    print(f"device: {results['device']}")

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))

    run_server_sections(args, tok, source.path, work, results, sections, save)
    report.publish(results, out_dir)
    return 0
