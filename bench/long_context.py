"""Prefill and decode deep in a long context: mlxserve vs llama.cpp on the same GGUF, one run.

Run: mlxserve bench long-context [MODEL.gguf] [--depths 4096,8192] [--out FILE]
(in a checkout also ``PYTHONPATH=. python -m bench.long_context``)

A coding agent's prompt is long (Claude Code's first one is ~20k tokens), so what it waits
for is attention over many keys, not the short-prompt prefill of `mlxserve bench latency`. For each
depth D this measures what llama-bench calls `pp512 @ dD` and `tg32 @ dD`:

- llama.cpp: `llama-bench -p 512 -n 32 -d D -fa 0,1 -t 2 -r 1` (flash attention off and on;
  the ratio is against the faster one).
- mlxserve: a request of D random tokens is prefilled and cached first; then a request
  with the same D tokens and 512 more, `max_tokens=33`, computes only the 512 (a prefix
  cache hit, chunks of 512 as llama-bench's ubatch): prefill tok/s = 512 / time to its
  first token, decode tok/s = 32 / the time of the 32 tokens after it.

The model defaults to the embedded SmolLM2-135M with its context raised to 32768 (the
agents harness's copy, `bench/agents/servers.py`). Load average printed at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path

from mlxserve.cli.bench import llamacpp

CHUNK, DECODE = 512, 32


def default_model() -> Path:
    """The embedded model with a 32k context (as the agents harness serves it)."""
    from bench.agents.servers import with_context
    from mlxserve.loader import resolve_model

    return with_context(Path(resolve_model(None).path), 32768)[0]


def llama_cpp(model: Path, depth: int, threads: int) -> dict[str, float]:
    """The faster of flash attention off / on, per test."""
    cmd = [str(llamacpp.bin_dir() / "llama-bench"), "-m", str(model), "-t", str(threads)]
    cmd += ["-p", str(CHUNK), "-n", str(DECODE), "-d", str(depth), "-fa", "0,1", "-r", "1"]
    cmd += ["-o", "json"]
    print("[llama.cpp]", " ".join(cmd), flush=True)
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out: dict[str, float] = {}
    for row in rows:
        key = "prefill_tok_s" if row["n_prompt"] else "decode_tok_s"
        out[key] = max(out.get(key, 0.0), row["avg_ts"])
    return out


def mlxserve(model: Path, depth: int) -> dict[str, float]:
    """pp512 and tg32 after a cached prefix of `depth` tokens."""
    from mlxserve import LLM, SamplingParams

    llm = LLM(str(model), max_model_len=depth + CHUNK + DECODE + 16, max_num_batched_tokens=CHUNK)
    vocab = llm.engine.tokenizer.vocab_size
    rng = random.Random(depth)
    prefix = [rng.randrange(100, vocab) for _ in range(depth)]
    tail = [rng.randrange(100, vocab) for _ in range(CHUNK)]
    llm.generate({"prompt_token_ids": prefix}, SamplingParams(max_tokens=1), use_tqdm=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=DECODE + 1, temperature=0, ignore_eos=True)
    engine.add_request("deep", prefix + tail, params)
    start, stamps = time.perf_counter(), []
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            stamps += [time.perf_counter()] * len(out.outputs[0].token_ids)
    llm.engine.shutdown()
    first, last = stamps[0], stamps[-1]
    return {"prefill_tok_s": CHUNK / (first - start), "decode_tok_s": DECODE / (last - first)}


def main(argv: list[str] | None = None) -> int:
    """Print one row per depth and engine, and the ratios."""
    parser = argparse.ArgumentParser(
        prog="mlxserve bench long-context",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--depths", default="4096,8192")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path)
    a = parser.parse_args(argv)
    model = a.model or default_model()
    result = {"model": str(model), "load_start": os.getloadavg()[0], "rows": []}
    print(f"model {model}; load average {result['load_start']:.2f}")
    for depth in (int(d) for d in a.depths.split(",")):
        ours = mlxserve(model, depth)
        peer = llama_cpp(model, depth, a.threads)
        ratios = {k: ours[k] / peer[k] for k in ours}
        result["rows"].append({"depth": depth, "mlxserve": ours, "llama.cpp": peer})
        for key in ("prefill_tok_s", "decode_tok_s"):
            name = f"pp{CHUNK}" if key == "prefill_tok_s" else f"tg{DECODE}"
            print(
                f"{name} @ d{depth}: mlxserve {ours[key]:8.1f} tok/s   llama.cpp "
                f"{peer[key]:8.1f} tok/s   ratio {ratios[key]:.2f}x",
                flush=True,
            )
    result["load_end"] = os.getloadavg()[0]
    print(f"load average at end {result['load_end']:.2f}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
