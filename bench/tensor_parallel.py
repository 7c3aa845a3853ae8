"""Tensor parallel vs one process: tokens/s, and what the ranks spend talking.

    PYTHONPATH=. python bench/tensor_parallel.py [--out results.json] [--skip-default]

Each case runs in a fresh process (MLX has one distributed group per process):
  - a random llama (hidden 512, 8 layers, 8 heads / 4 KV heads, float32) at TP 1 and 2;
  - the embedded SmolLM2-135M Q4_1 at TP 1 and 3 (its 9 heads / 3 KV heads do not split 2).
Workloads: batch = 8 prompts x 16 output tokens (greedy, EOS ignored), single = one
prompt x 32 tokens (short: the machine is shared). Per step: the SPMD metadata message
(its bytes and the time rank 0 spends sending it, measured by StepChannel), and
separately the latency of one all_sum
of the forward's size (num_tokens x hidden float32) between 2 ranks (``allsum``, run
under mlx.launch). A forward does 2 of those per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCH_MODEL = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
)


def run_case(model: str, tp: int) -> dict:
    """One engine (this process is rank 0): the two workloads and the channel counters."""
    import mlx.core as mx

    from mlxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model or None, tensor_parallel_size=tp, dtype="float32", num_blocks=256)
    load = time.perf_counter() - t0
    engine = llm.engine
    steps = 0
    step = engine.step

    def counted(*args, **kwargs):
        nonlocal steps
        steps += 1
        return step(*args, **kwargs)

    engine.step = counted
    vocab = engine.vocab_size
    prompts = [[(i * 37 + j * 11) % vocab for j in range(32)] for i in range(8)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    out = {"model": model or "SmolLM2-135M Q4_1", "tp": tp, "load_s": round(load, 2)}
    channel = engine.runner.channel
    for name, batch, n in (("batch", prompts, 16), ("single", prompts[:1], 32)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        before = (channel.num_messages, channel.num_bytes, channel.seconds) if channel else None
        steps = 0
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"tok_s": round(tokens / wall, 1), "steps": steps, "ms_per_step": wall / steps * 1e3}
        if channel is not None:
            msgs = channel.num_messages - before[0]
            row["messages"] = msgs
            row["bytes_per_message"] = round((channel.num_bytes - before[1]) / max(msgs, 1))
            row["send_ms_per_message"] = (channel.seconds - before[2]) / max(msgs, 1) * 1e3
        out[name] = row
    out["device"] = str(mx.default_device())
    llm.shutdown()
    return out


def allsum(sizes: list[tuple[int, int]], iters: int = 200) -> None:
    """Under mlx.launch: median latency of all_sum((tokens, hidden) float32); rank 0 prints."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    results = []
    for tokens, hidden in sizes:
        x = mx.ones((tokens, hidden), dtype=mx.float32)
        mx.eval(mx.distributed.all_sum(x, group=group))
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - t)
        results.append(
            {"tokens": tokens, "hidden": hidden, "bytes": tokens * hidden * 4,
             "median_us": statistics.median(times) * 1e6}
        )  # fmt: skip
    if group.rank() == 0:
        print("RESULT", json.dumps(results), flush=True)


def _child(args: list[str], timeout: float = 600) -> dict | list:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _allsum_run(sizes: list[tuple[int, int]]) -> list:
    launcher = Path(sys.executable).parent / "mlx.launch"
    spec = json.dumps(sizes)
    cmd = [str(launcher), "-n", "2", "--backend", "ring", "--python", sys.executable]
    cmd += ["--env", f"PYTHONPATH={ROOT}", __file__, "allsum", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"allsum failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write every number here (JSON)")
    parser.add_argument("--skip-default", action="store_true", help="only the random llama")
    args = parser.parse_args()
    from tests.engine_helpers import make_tiny_model_dir

    with open("/proc/loadavg") as f:
        load_start = f.read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        _, model_dir = make_tiny_model_dir(Path(tmp), seed=0, **BENCH_MODEL)
        cases = [(str(model_dir), 1), (str(model_dir), 2)]
        if not args.skip_default:
            cases += [("", 1), ("", 3)]
        results = [_child(["run", model, str(tp)]) for model, tp in cases]
    sizes = [(t, h) for h in (512, 576, 8192) for t in (1, 8, 32)]
    allsums = _allsum_run(sizes)
    with open("/proc/loadavg") as f:
        load_end = f.read().split()[:3]
    print(f"load average at start {load_start}, at end {load_end}")
    print("| model | TP | batch tok/s | ms/step | single tok/s | ms/step | msg bytes | send ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        b, s = r["batch"], r["single"]
        print(
            f"| {Path(r['model']).name or r['model']} | {r['tp']} | {b['tok_s']} | "
            f"{b['ms_per_step']:.1f} | {s['tok_s']} | {s['ms_per_step']:.1f} | "
            f"{b.get('bytes_per_message', '-')} | "
            + (f"{b['send_ms_per_message']:.2f}" if "send_ms_per_message" in b else "-")
            + " |"
        )
    print("\n| all_sum tokens x hidden (float32) | bytes | median us (2 ranks, ring, 127.0.0.1) |")
    print("|---|---|---|")
    for a in allsums:
        print(f"| {a['tokens']} x {a['hidden']} | {a['bytes']} | {a['median_us']:.0f} |")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"cases": results, "allsum": allsums, "load": [load_start, load_end]}, indent=2
            )
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        print("RESULT", json.dumps(run_case(sys.argv[2], int(sys.argv[3]))), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "allsum":
        allsum([tuple(s) for s in json.loads(sys.argv[2])])
    else:
        main()
