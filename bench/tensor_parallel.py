"""Tensor and pipeline parallel vs one process: tokens/s, what the ranks spend talking,
and (pipeline) how long each rank idles.

    PYTHONPATH=. python bench/tensor_parallel.py [--out results.json] [--skip-default]

Each case runs in a fresh process (MLX has one distributed group per process):
  - a random llama (hidden 512, 8 layers, 8 heads / 4 KV heads, float32) at TP 1 and 2,
    and PP 2 with micro-batches of >= 64 tokens (the default: prefill steps split, decode
    steps do not), in every step (>= 1 token) and never;
  - the embedded SmolLM2-135M Q4_1 at TP 1 and 3 (its 9 heads / 3 KV heads do not split
    2) and PP 2.
Workloads: batch = 8 prompts x 16 output tokens (greedy, EOS ignored), single = one
prompt x 32 tokens (short: the machine is shared). Per step: the SPMD metadata message
(its bytes and the time rank 0 spends sending it, measured by StepChannel); under PP the
hidden-state and logits bytes that cross ranks, and rank 1's counters
(worker/pipeline.py): its idle share (waiting for the step's message or a micro-batch)
and its tail (last micro-batch in -> logits out), which rank 0 waits at least.
Separately, under mlx.launch (``comm``): the latency of one all_sum (a TP forward does 2
per layer of step tokens x hidden) and of one send -> recv (a PP forward sends step
tokens x hidden per stage boundary, and the needed rows' logits back) at those sizes.
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


def _counters(llm) -> dict:
    """Rank 0's channel and stage counters, and rank 1's (pipeline) counters."""
    from mlxserve.worker.pipeline import STAT_NAMES

    engine = llm.engine
    channel = engine.runner.channel
    out = {}
    if channel is not None:
        out |= {"messages": channel.num_messages, "bytes": channel.num_bytes}
        out["seconds"] = channel.seconds
    stage = engine.model
    if hasattr(stage, "num_bytes_sent"):
        rank1 = channel.gather_stats([])[1]
        out |= {"hidden_bytes": stage.num_bytes_sent, "logits_bytes": stage.num_bytes_received}
        out |= {"rank1": dict(zip(STAT_NAMES, rank1, strict=False))}
    return out


def _window(before: dict, after: dict, steps: int) -> dict:
    """Per-step communication and rank 1's idle shares between two counter readings."""
    row: dict = {}
    if "messages" in before:
        msgs = after["messages"] - before["messages"]
        row["bytes_per_message"] = round((after["bytes"] - before["bytes"]) / max(msgs, 1))
        row["send_ms_per_message"] = (after["seconds"] - before["seconds"]) / max(msgs, 1) * 1e3
    if "rank1" in before:
        r0, r1 = before["rank1"], after["rank1"]
        d = {k: r1[k] - r0[k] for k in r1}
        wall = max(d["wall_s"], 1e-9)
        forwards = max(d["forwards"], 1)
        row["hidden_bytes_per_step"] = round(
            (after["hidden_bytes"] - before["hidden_bytes"]) / steps
        )
        row["logits_bytes_per_step"] = round(
            (after["logits_bytes"] - before["logits_bytes"]) / steps
        )
        row["rank1_idle"] = (d["message_wait_s"] + d["micro_batch_wait_s"]) / wall
        row["rank1_idle_in_step"] = d["micro_batch_wait_s"] / wall
        row["rank1_busy"] = d["busy_s"] / wall
        row["rank0_idle_at_least"] = d["tail_s"] / wall
        row["rank1_ms_per_forward"] = {
            k[:-2]: d[k] / forwards * 1e3
            for k in ("message_wait_s", "micro_batch_wait_s", "busy_s", "return_s", "tail_s")
        }
    return row


def run_case(model: str, tp: int, pp: int, micro: int | None) -> dict:
    """One engine (this process is rank 0): the two workloads and the counters."""
    import mlx.core as mx

    from mlxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model or None,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_micro_batch_tokens=micro or 64,
        dtype="float32",
        num_blocks=256,
    )
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
    out = {"model": model or "SmolLM2-135M Q4_1", "tp": tp, "pp": pp, "micro": micro}
    out["load_s"] = round(load, 2)
    for name, batch, n in (("batch", prompts, 16), ("single", prompts[:1], 32)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        before = _counters(llm)
        steps = 0
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"tok_s": round(tokens / wall, 1), "steps": steps, "ms_per_step": wall / steps * 1e3}
        out[name] = row | _window(before, _counters(llm), steps)
    out["device"] = str(mx.default_device())
    llm.shutdown()
    return out


def comm(sizes: list[tuple[int, int]], iters: int = 100) -> None:
    """Under mlx.launch: median latency of all_sum((rows, width) float32) and of a send
    0 -> 1 (half a ping-pong); rank 0 prints."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    rank = group.rank()
    results = []

    def timed(run) -> float:
        run()  # warm-up
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    for rows, width in sizes:
        x = mx.ones((rows, width), dtype=mx.float32)

        def ping_pong(x: mx.array = x) -> None:
            if rank == 0:
                mx.eval(mx.distributed.send(x, 1, group=group))
                mx.eval(mx.distributed.recv_like(x, 1, group=group))
            else:
                y = mx.distributed.recv_like(x, 0, group=group)
                mx.eval(y)
                mx.eval(mx.distributed.send(y, 0, group=group))

        all_sum_us = timed(lambda x=x: mx.eval(mx.distributed.all_sum(x, group=group)))
        send_us = timed(ping_pong) / 2
        results.append(
            {"rows": rows, "width": width, "bytes": rows * width * 4,
             "all_sum_us": all_sum_us, "send_us": send_us}
        )  # fmt: skip
    if rank == 0:
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


def _comm_run(sizes: list[tuple[int, int]]) -> list:
    launcher = Path(sys.executable).parent / "mlx.launch"
    spec = json.dumps(sizes)
    cmd = [str(launcher), "-n", "2", "--backend", "ring", "--python", sys.executable]
    cmd += ["--env", f"PYTHONPATH={ROOT}", __file__, "comm", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"comm failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


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
        llama = str(model_dir)
        # (model, TP, PP, pipeline_micro_batch_tokens: 1 splits every step with 2+
        # requests, 10**9 none, None the default 64)
        cases = [(llama, 1, 1, None), (llama, 2, 1, None), (llama, 1, 2, None)]
        cases += [(llama, 1, 2, 1), (llama, 1, 2, 10**9)]
        if not args.skip_default:
            cases += [("", 1, 1, None), ("", 3, 1, None), ("", 1, 2, None)]
        results = [_child(["run", m, str(tp), str(pp), str(mb or 0)]) for m, tp, pp, mb in cases]
    # Hidden states (tokens x hidden) and logits rows (rows x vocab: SmolLM2's 49152).
    sizes = [(t, h) for h in (512, 576, 8192) for t in (1, 8, 32)] + [(1, 49152), (8, 49152)]
    comms = _comm_run(sizes)
    with open("/proc/loadavg") as f:
        load_end = f.read().split()[:3]
    print(f"load average at start {load_start}, at end {load_end}")
    print(
        "| model | TP | PP | micro-batch tokens | batch tok/s | ms/step | single tok/s | ms/step "
        "| msg bytes | send ms | hidden B/step | logits B/step | rank 1 idle | rank 0 idle >= |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b, s = r["batch"], r["single"]
        micro = "-" if r["pp"] == 1 else (r["micro"] or 64)
        print(
            f"| {Path(r['model']).name or r['model']} | {r['tp']} | {r['pp']} | {micro} | "
            f"{b['tok_s']} | {b['ms_per_step']:.1f} | {s['tok_s']} | {s['ms_per_step']:.1f} | "
            f"{b.get('bytes_per_message', '-')} | {_fmt(b.get('send_ms_per_message'))} | "
            f"{b.get('hidden_bytes_per_step', '-')} | {b.get('logits_bytes_per_step', '-')} | "
            f"{_fmt(b.get('rank1_idle'))} | {_fmt(b.get('rank0_idle_at_least'))} |"
        )
    print("\n| rows x width (float32) | bytes | all_sum us | send us (2 ranks, ring, 127.0.0.1) |")
    print("|---|---|---|---|")
    for c in comms:
        print(
            f"| {c['rows']} x {c['width']} | {c['bytes']} | {c['all_sum_us']:.0f} | "
            f"{c['send_us']:.0f} |"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"cases": results, "comm": comms, "load": [load_start, load_end]}, indent=2)
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        model, tp, pp, micro = sys.argv[2], *map(int, sys.argv[3:6])
        print("RESULT", json.dumps(run_case(model, tp, pp, micro or None)), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "comm":
        comm([tuple(s) for s in json.loads(sys.argv[2])])
    else:
        main()
