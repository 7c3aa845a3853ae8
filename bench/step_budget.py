"""What the step token budget (--max-num-batched-tokens) costs and buys, in one process.

    PYTHONPATH=. python bench/step_budget.py --budgets 32,48,64,96,128,256 --rounds 2

One engine per budget on the same loaded weights (the default model unless MODEL),
stepped directly (no HTTP), rounds in alternating budget order. Process CPU time is
reported beside wall time: on a shared machine it moves far less.

    mixed   8 streams decode; a 512-token prompt arrives. While it is computed, each
            step's time is the streams' inter-token latency; its TTFT is their sum.
    burst   32 prompts of 32 tokens arrive together, 32 output tokens each: steps and
            CPU per output token.
    rows    one prefill chunk of N tokens alone (--rows): CPU per row by chunk size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from mlxserve.cli.bench import make_prompts  # noqa: E402
from mlxserve.config import EngineConfig  # noqa: E402
from mlxserve.engine.llm_engine import LLMEngine  # noqa: E402
from mlxserve.loader import LoadedModel, load_model  # noqa: E402
from mlxserve.ops import AttentionMetadata  # noqa: E402
from mlxserve.sampling_params import SamplingParams  # noqa: E402

NUM_STREAMS = 8
LONG_PROMPT = 512


def timed_step(engine: LLMEngine) -> tuple[float, float, list]:
    """(wall s, process CPU s, outputs) of one engine step."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = engine.step()
    return time.perf_counter() - wall, time.process_time() - cpu, outputs


def mixed(engine: LLMEngine, tok, round_: int) -> dict[str, float]:
    streams = make_prompts(tok, NUM_STREAMS, 32, start=20_000 + round_)
    endless = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(streams):
        engine.add_request(f"s{round_}-{i}", prompt, endless)
    for _ in range(12):  # the streams' prompts (8 x 32 tokens), then they decode
        timed_step(engine)
    base = [timed_step(engine)[:2] for _ in range(6)]
    long_id = f"long{round_}"
    long_prompt = make_prompts(tok, 1, LONG_PROMPT, start=21_000 + round_)[0]
    engine.add_request(long_id, long_prompt, SamplingParams(max_tokens=1, temperature=0))
    steps = []
    while True:
        wall, cpu, outputs = timed_step(engine)
        steps.append((wall, cpu))
        if any(o.request_id == long_id and o.finished for o in outputs):
            break
    engine.abort_request([f"s{round_}-{i}" for i in range(NUM_STREAMS)])
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "decode_step_ms": 1000 * statistics.median(w for w, _ in base),
        "decode_step_cpu_ms": 1000 * statistics.median(c for _, c in base),
        "prefill_step_ms": 1000 * statistics.median(w for w, _ in steps),
        "prefill_step_cpu_ms": 1000 * statistics.median(c for _, c in steps),
        "prefill_step_max_ms": 1000 * max(w for w, _ in steps),
        "prefill_steps": len(steps),
        "ttft_s": sum(w for w, _ in steps),
        "ttft_cpu_s": sum(c for _, c in steps),
    }


def burst(engine: LLMEngine, tok, round_: int) -> dict[str, float]:
    prompts = make_prompts(tok, 32, 32, start=10_000 + 1000 * round_)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{round_}-{i}", prompt, params)
    steps, wall, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    num_tokens = 32 * len(prompts)
    return {
        "steps": steps,
        "ms_per_token": 1000 * (time.perf_counter() - wall) / num_tokens,
        "cpu_ms_per_token": 1000 * (time.process_time() - cpu) / num_tokens,
    }


def chunk_rows(loaded: LoadedModel, sizes: list[int], rounds: int) -> dict[int, float]:
    """Process CPU ms per row of one prefill chunk of each size (median of rounds)."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=None, num_blocks=64), loaded=loaded)
    runner, model = engine.runner, loaded.model
    runner.ensure_blocks(64)
    cache = runner.kv_cache
    mx.eval(cache.arrays())
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes if r % 2 == 0 else sizes[::-1]:
            table = list(range(1, -(-n // 16) + 1))
            md = AttentionMetadata.build([n], [n], [table], 16)
            ids = mx.arange(n, dtype=mx.int32) % 1000 + 100
            cpu = time.process_time()
            logits = model(
                ids,
                mx.arange(n, dtype=mx.int32),
                md,
                cache,
                logits_indices=mx.array([n - 1], dtype=mx.int32),
            )
            mx.eval(logits, cache.arrays())
            times[n].append(time.process_time() - cpu)
    engine.shutdown()
    return {n: 1000 * statistics.median(times[n]) / n for n in sizes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--budgets", default="32,64,128,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", default="", help="chunk sizes for the rows part, e.g. 32,64,128")
    args = p.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    engines = {
        b: LLMEngine(
            EngineConfig.from_kwargs(model=args.model, max_num_batched_tokens=b, max_num_seqs=64),
            loaded=loaded,
        )
        for b in budgets
    }
    results: dict[int, dict[str, list[dict]]] = {b: {"mixed": [], "burst": []} for b in budgets}
    for r in range(args.rounds):
        for b in budgets if r % 2 == 0 else budgets[::-1]:
            results[b]["mixed"].append(mixed(engines[b], tok, r))
            results[b]["burst"].append(burst(engines[b], tok, r))
            print(f"budget {b} round {r} done (load {os.getloadavg()[0]:.1f})", flush=True)
    print(
        "\n| budget | decode-only step ms (CPU) | step while the prompt is computed ms (CPU) "
        "| / decode-only (CPU) | max ms | prompt TTFT s (CPU) | its steps | burst steps "
        "| burst CPU ms / token | burst ms / token |"
    )
    print("|" + "---:|" * 10)
    for b in budgets:
        m = {
            k: statistics.median(d[k] for d in results[b]["mixed"]) for k in results[b]["mixed"][0]
        }
        u = {
            k: statistics.median(d[k] for d in results[b]["burst"]) for k in results[b]["burst"][0]
        }
        print(
            f"| {b} | {m['decode_step_ms']:.0f} ({m['decode_step_cpu_ms']:.0f}) "
            f"| {m['prefill_step_ms']:.0f} ({m['prefill_step_cpu_ms']:.0f}) "
            f"| {m['prefill_step_cpu_ms'] / m['decode_step_cpu_ms']:.1f} "
            f"| {m['prefill_step_max_ms']:.0f} | {m['ttft_s']:.2f} ({m['ttft_cpu_s']:.2f}) "
            f"| {m['prefill_steps']:.0f} | {u['steps']:.0f} | {u['cpu_ms_per_token']:.1f} "
            f"| {u['ms_per_token']:.1f} |"
        )
    for engine in engines.values():
        engine.shutdown()
    if args.rows:
        sizes = [int(n) for n in args.rows.split(",") if n]
        per_row = chunk_rows(loaded, sizes, max(args.rounds, 3))
        print("\n| prefill chunk rows | CPU ms per row |\n|---:|---:|")
        for n, ms in per_row.items():
            print(f"| {n} | {ms:.2f} |")
    print(f"\nload average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
