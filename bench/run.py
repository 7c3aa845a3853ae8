"""The side-by-side suite: mlxserve, mlx-lm and llama.cpp on the same weights, one run.

    PYTHONPATH=. python bench/run.py                 # embedded SmolLM2-135M Q4_1 GGUF
    PYTHONPATH=. python bench/run.py MODEL.gguf --out results/ --skip serving

Sections (bench/README.md says what each measures): offline, serving (concurrency
1/8/32), mixed, busy, prefix, memory. Prints tables and ratios; writes OUT/results.json and
OUT/chart.png. llama.cpp is built on first use (bench/peers/llamacpp.py); --peers chooses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import memory, serving  # noqa: E402
from bench.common import (  # noqa: E402
    STOCK_ENV,
    child_env,
    find_openblas,
    mlx_lm_model,
    openblas_env,
    run_json,
    run_mlx_lm_offline,
)
from bench.peers import llamacpp  # noqa: E402
from bench.report import print_report, write_chart  # noqa: E402
from mlxserve.cli.bench import OfflineSpec, make_prompts  # noqa: E402

SECTIONS = ("offline", "serving", "mixed", "busy", "prefix", "memory")
PEERS = ("mlxserve", "mlxserve-float", "mlxserve-int8", "mlx-lm", "llama.cpp")
# mlxserve with int8 activations (MLXSERVE_CPU_INT8=on): the offline section only.
MLXSERVE_VARIANTS = {  # mlxserve as configured (int8 activations where the CPU has them)
    "mlxserve": {},
    "mlxserve-float": {"MLXSERVE_CPU_INT8": "off"},
    "mlxserve-int8": {"MLXSERVE_CPU_INT8": "on"},
}


def conditions() -> dict[str, object]:
    """Load on the machine when the run starts (shared machines make noise)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"loadavg": load, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def offline(args, spec: OfflineSpec, tok, gguf: Path, work: Path) -> dict[str, dict]:
    res: dict[str, dict] = {}
    for name, extra_env in MLXSERVE_VARIANTS.items():
        if name not in args.peers:
            continue
        out = work / f"{name}-offline.json"
        cmd = [sys.executable, "-m", "mlxserve.cli", "bench", str(gguf), "--json", str(out)]
        cmd += [
            "--decode-tokens",
            str(spec.decode_tokens),
            "--batch-tokens",
            str(spec.batch_tokens),
        ]
        cmd += [
            "--prefill-tokens",
            str(spec.prefill_tokens),
            "--prompt-tokens",
            str(spec.prompt_tokens),
        ]
        cmd += ["--batch-sizes", *map(str, spec.batch_sizes)]
        cmd += ["--no-async-scheduling"] if args.no_async_scheduling else []
        data = run_json(cmd, child_env(extra_env), out)
        res[name] = data["offline"]
        res[name]["profile"] = data.get("profile")
    if "mlx-lm" in args.peers:
        payload = {
            "decode_prompt": make_prompts(tok, 1, spec.prompt_tokens)[0],
            "decode_tokens": spec.decode_tokens,
            "prefill_prompt": make_prompts(tok, 1, spec.prefill_tokens, start=500)[0],
            "batches": {
                str(n): make_prompts(tok, n, spec.prompt_tokens, start=1000 * n)
                for n in spec.batch_sizes
            },
            "batch_tokens": spec.batch_tokens,
            "kv_lengths": [1, 100, 256, 300, 1000],
        }
        runs = [("mlx-lm", "q", STOCK_ENV)]
        blas = find_openblas()
        if blas and not args.no_mlx_lm_openblas:
            runs.append(("mlx-lm+openblas", "f32", openblas_env(blas)))
        for name, variant, env in runs:
            if variant not in args.mlx_dirs:  # converted on first use: it takes a while
                args.mlx_dirs[variant] = mlx_lm_model(str(args.gguf), variant)
            model = {"model": str(args.mlx_dirs[variant])}
            res[name] = run_mlx_lm_offline(payload | model, env, work, name)
            res[name]["weights"] = variant
    if "llama.cpp" in args.peers:
        res["llama.cpp"] = llamacpp.offline(gguf, spec, args.threads)
    return res


def server_specs(
    args, gguf: Path, parallel: int, ctx_per_slot: int
) -> dict[str, serving.ServerSpec]:
    specs = {}
    mlxserve_cmd = [sys.executable, "-m", "mlxserve.cli", "serve", str(gguf)]
    mlxserve_cmd += [
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        "--max-num-seqs",
        "64",
    ]
    if args.max_num_batched_tokens:
        mlxserve_cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_async_scheduling:
        mlxserve_cmd += ["--no-async-scheduling"]
    if "mlxserve" in args.peers:
        specs["mlxserve"] = serving.ServerSpec("mlxserve", mlxserve_cmd)
    if "mlx-lm" in args.peers:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(args.mlx_dirs["q"])]
        specs["mlx-lm"] = serving.ServerSpec(
            "mlx-lm", cmd + ["--log-level", "WARNING"], env=STOCK_ENV
        )
    if "llama.cpp" in args.peers:
        cmd = llamacpp.server_cmd(gguf, args.threads, parallel, ctx_per_slot)
        specs["llama.cpp"] = serving.ServerSpec("llama.cpp", cmd)
    return specs


def text_prompts(tok, count: int, num_tokens: int, start: int) -> list[str]:
    return [tok.decode(ids) for ids in make_prompts(tok, count, num_tokens, start=start)]


def note_rss(rss: dict[str, dict], name: str, srv: serving.Server) -> None:
    """Record a stopped server's resident memory: when ready, and its peak."""
    rss[name] = {"ready_mib": srv.ready_rss_mib, "peak_mib": srv.peak_rss_mib}
    print(f"[{name}] RSS when ready {_mib(srv.ready_rss_mib)}, peak {_mib(srv.peak_rss_mib)}")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MiB"


def run_serving(args, tok, gguf: Path, work: Path, rss: dict[str, dict]) -> dict[str, dict]:
    res: dict[str, dict] = {}
    for name, spec in server_specs(args, gguf, max(args.concurrency), 256).items():
        res[name] = {}
        with serving.Server(spec, work) as srv:
            for c in args.concurrency:
                per = max(1, args.requests // c) if c < args.requests else 1
                texts = text_prompts(tok, c * per, 32, start=10_000 + 100 * c)
                prompts = [texts[i * per : (i + 1) * per] for i in range(c)]
                cpu = serving.cpu_seconds(srv.proc.pid)
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
    # Streams restart if they end (bench/serving.py), so stream_tokens only has to fit
    # llama-server's per-slot context (ctx_per_slot, with the prompt).
    res = {}
    slots = len(streams) + len(arrivals)
    for name, spec in server_specs(args, gguf, slots, ctx_per_slot).items():
        with serving.Server(spec, work) as srv:
            res[name] = asyncio.run(
                serving.under_load(srv.url, streams, stream_tokens, arrivals, arrival_tokens, gap_s)
            )
        note_rss(rss, name, srv)
        print(f"[{name}] {label}: {json.dumps({k: round(v, 2) for k, v in res[name].items()})}")
    return res


def run_prefix(args, tok, gguf: Path, work: Path, rss: dict[str, dict]) -> dict[str, dict]:
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
        with serving.Server(spec, work) as srv:
            res[name] = asyncio.run(serving.shared_prefix(srv.url, prompts, 8))
        note_rss(rss, name, srv)
        print(
            f"[{name}] shared prefix: {json.dumps({k: round(v, 1) for k, v in res[name].items()})}"
        )
    return res


def run_memory(args, results: dict) -> dict:
    from mlxserve.loader import load_model

    loaded = load_model(str(args.gguf), skip_tokenizer_init=True)
    m = loaded.model
    per_token = memory.kv_bytes_per_token(
        m.num_layers, m.num_kv_heads, m.head_dim, loaded.dtype.size
    )
    out = memory.analyze(per_token, 16, args.kv_budget_mb * 2**20)
    out["kv_dtype"] = str(loaded.dtype)
    mlx_lm = results.get("offline", {}).get("mlx-lm", {})
    if "kv_bytes" in mlx_lm:
        out["mlx_lm_measured_kv_bytes"] = mlx_lm["kv_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS)
    )
    p.add_argument(
        "--skip", default="", help="comma-separated sections to skip: " + ",".join(SECTIONS)
    )
    p.add_argument("--out", default=None, help="results folder (default: a new temp folder)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=32)
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
    p.add_argument("--kv-budget-mb", type=int, default=1024)
    p.add_argument("--no-mlx-lm-openblas", action="store_true", help="skip mlx-lm + OpenBLAS")
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
    args = p.parse_args(argv)
    args.peers = [x for x in args.peers.split(",") if x]
    skip = {x for x in args.skip.split(",") if x}

    from mlxserve.cli.bench import device_info
    from mlxserve.loader import resolve_model
    from mlxserve.tokenizer import Tokenizer

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise SystemExit("bench/run.py needs a .gguf MODEL (llama.cpp reads it directly)")
    args.gguf = gguf = source.path
    tok = Tokenizer.from_gguf(gguf)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="mlxserve-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "logs"
    work.mkdir(exist_ok=True)
    if "mlx-lm" in args.peers:
        args.mlx_dirs = {"q": mlx_lm_model(str(gguf), "q")}  # "f32": by offline(), if used
    if "llama.cpp" in args.peers:
        llamacpp.ensure_built()
    spec = OfflineSpec(
        decode_tokens=args.decode_tokens,
        prefill_tokens=args.prefill_tokens,
        batch_tokens=args.batch_tokens,
    )
    results: dict[str, object] = {
        "model": source.name,
        "device": device_info(),
        "conditions": conditions(),
        "spec": asdict(spec),
        "args": {k: v for k, v in vars(args).items() if k not in ("mlx_dirs", "gguf")},
    }
    print(f"device: {results['device']}")
    steps = {
        "offline": offline,
        "serving": run_serving,
        "mixed": run_mixed,
        "busy": run_busy,
        "prefix": run_prefix,
    }
    for section in SECTIONS:
        if section in skip:
            continue
        if section == "offline":
            results["offline"] = offline(args, spec, tok, gguf, work)
        elif section == "memory":
            results["memory"] = run_memory(args, results)
        else:
            rss = results.setdefault("rss", {}).setdefault(section, {})
            results[section] = steps[section](args, tok, gguf, work, rss)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    results["conditions"]["loadavg_end"] = os.getloadavg()
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print_report(results)
    write_chart(results, out_dir / "chart.png")
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'chart.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
