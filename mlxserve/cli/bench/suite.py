"""`mlxserve bench peers`: mlxserve, mlx-lm and llama.cpp on the same weights, in one run.

Sections (bench/README.md says what each measures): offline, serving (concurrency
1/8/32), mixed, busy, prefix, memory. Prints tables and ratios; writes OUT/results.json and
OUT/chart.png. llama.cpp is built on first use (llamacpp.py); --peers chooses the engines.
The server sections are `mlxserve bench serve`'s, run against each peer's server in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from mlxserve.cli.bench.serve import SERVER_SECTIONS, add_server_flags, run_server_sections
from mlxserve.cli.bench.workload import OfflineSpec, conditions, device_info, make_prompts

SECTIONS = ("offline", *SERVER_SECTIONS, "memory")
PEERS = ("mlxserve", "mlxserve-float", "mlxserve-int8", "mlx-lm", "llama.cpp")
# mlxserve with int8 activations (MLXSERVE_CPU_INT8=on): the offline section only.
MLXSERVE_VARIANTS = {  # mlxserve as configured (int8 activations where the CPU has them)
    "mlxserve": {},
    "mlxserve-float": {"MLXSERVE_CPU_INT8": "off"},
    "mlxserve-int8": {"MLXSERVE_CPU_INT8": "on"},
}


def offline(args, spec: OfflineSpec, tok, gguf: Path, work: Path) -> dict[str, dict]:
    """Each peer's offline numbers, each engine in a process of its own."""
    from mlxserve.cli.bench import llamacpp
    from mlxserve.cli.bench.common import (
        STOCK_ENV,
        child_env,
        find_openblas,
        mlx_lm_model,
        openblas_env,
        run_json,
        run_mlx_lm_offline,
    )

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


def run_memory(args, results: dict) -> dict:
    """KV bytes per token, and how many requests of a fixed workload fit the budget."""
    from mlxserve.cli.bench import memory
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


def add_peers_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS)
    )
    p.add_argument(
        "--skip", default="", help="comma-separated sections to skip: " + ",".join(SECTIONS)
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--kv-budget-mb", type=int, default=1024)
    p.add_argument("--no-mlx-lm-openblas", action="store_true", help="skip mlx-lm + OpenBLAS")
    add_server_flags(p)


def peers_command(args: argparse.Namespace) -> int:
    from mlxserve.cli.bench import llamacpp, report
    from mlxserve.cli.bench.common import mlx_lm_model
    from mlxserve.loader import resolve_model
    from mlxserve.tokenizer import Tokenizer

    args.peers = [x for x in args.peers.split(",") if x]
    skip = {x for x in args.skip.split(",") if x}
    unknown = [x for x in args.peers if x not in PEERS] + [x for x in skip if x not in SECTIONS]
    if unknown:
        raise ValueError(
            f"unknown peer or section {unknown[0]!r} (--peers: {', '.join(PEERS)}; "
            f"--skip: {', '.join(SECTIONS)})"
        )
    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise ValueError("`mlxserve bench peers` needs a .gguf MODEL (llama.cpp reads it directly)")
    args.gguf = gguf = source.path
    tok = Tokenizer.from_gguf(gguf)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="mlxserve-bench-"))
    work = out_dir / "logs"
    work.mkdir(parents=True, exist_ok=True)
    if "mlx-lm" in args.peers:
        args.mlx_dirs = {"q": mlx_lm_model(str(gguf), "q")}  # "f32": by offline(), if used
    if "llama.cpp" in args.peers:
        llamacpp.ensure_built()
    spec = OfflineSpec(
        decode_tokens=args.decode_tokens,
        prefill_tokens=args.prefill_tokens,
        batch_tokens=args.batch_tokens,
    )
    hidden = ("mlx_dirs", "gguf", "handler")
    results: dict[str, object] = {
        "model": source.name,
        "device": device_info(),
        "conditions": conditions(),
        "spec": asdict(spec),
        "args": {k: v for k, v in vars(args).items() if k not in hidden},
    }
    print(f"device: {results['device']}")

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))

    if "offline" not in skip:
        results["offline"] = offline(args, spec, tok, gguf, work)
        save()
    servers = [s for s in SERVER_SECTIONS if s not in skip]
    run_server_sections(args, tok, gguf, work, results, servers, save)
    if "memory" not in skip:
        results["memory"] = run_memory(args, results)
    report.publish(results, out_dir)
    return 0
