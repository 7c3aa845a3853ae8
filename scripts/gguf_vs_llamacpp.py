"""GGUF files as tests/test_loader_gguf_families.py writes them, through llama.cpp: a 2nd oracle.

The tests write each family's tiny random model as llama.cpp's converter does
(tests/gguf_llamacpp.py) and check mlxserve's loader against mlx-lm on the HF weights
(this script repeats that check, for the llama, qwen2 and qwen3 files too).
This script asks llama.cpp, the reference reader of GGUF, whether it reads those files as
the same model: each file (with a stub vocabulary added) is served by llama-server, and its
greedy tokens and their log-probs are compared with mlx-lm's. Where the tokens part,
llama.cpp's prefill of the common prefix is compared with mlx-lm's next-token log-probs:
equal tops there point at llama.cpp's decode arithmetic rather than at the file.

Needs the bench's llama.cpp build (mlxserve/cli/bench/llamacpp.py; ~10 minutes once, 2 cores);
never in CI. Tiny models, one llama-server at a time on 127.0.0.1, a few seconds each.

    python scripts/gguf_vs_llamacpp.py [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from mlxserve.cli.bench.llamacpp import bin_dir  # noqa: E402
from mlxserve.loader import load_model  # noqa: E402
from tests.model_helpers import mlx_lm_chunk_logits  # noqa: E402
from tests.test_loader_gguf_families import (  # noqa: E402
    CASES,
    MXFP4_EXPERTS,
    TOKENS,
    oracle_and_gguf,
    paged_logits,
)
from tests.zoo_configs import ZOO  # noqa: E402

# The architectures mlxserve's own models run (tested against mlx-lm elsewhere) join them.
CASES = CASES | {name: ZOO[name] for name in ("llama", "qwen2", "qwen3")}

PROMPTS = ((1, 5), (2, 23), (3, 12))  # (seed, length): shorter and longer than the windows
STEPS = 10


class LlamaServer:
    """llama-server on one GGUF file, on a free 127.0.0.1 port."""

    def __init__(self, path: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = path.with_suffix(".log")
        cmd = [str(bin_dir() / "llama-server"), "-m", str(path), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "-c", "256", "-np", "1", "-t", "1", "--no-warmup"]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server refused {path.name}: {self._error()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not start on {path.name}")

    def _error(self) -> str:
        lines = [line for line in self.log.read_text().splitlines() if " E " in line]
        return lines[0].split(" E ", 1)[1] if lines else "(no error logged)"

    def complete(self, prompt: list[int], n: int, n_probs: int = 0) -> dict:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False}
        body |= {"return_tokens": True, "n_probs": n_probs}  # no ignore_eos: it bans a token
        body |= {"post_sampling_probs": False}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def llamacpp(path: Path, prompt: list[int], n: int, n_probs: int = 0) -> dict:
    """One completion by a fresh llama-server (its KV cache state is never shared)."""
    server = LlamaServer(path)
    try:
        return server.complete(prompt, n, n_probs)
    finally:
        server.close()


def check(name: str, workdir: Path) -> str:
    """One case: 'equal' or where and how llama.cpp and mlx-lm part."""
    quantize = MXFP4_EXPERTS if name == "gpt-oss" else None
    oracle, path = oracle_and_gguf(name, CASES[name], workdir, quantize=quantize, stub_vocab=True)
    loaded = load_model(str(path), skip_tokenizer_init=True)
    ours = np.abs(paged_logits(loaded.model) - mlx_lm_chunk_logits(oracle, [TOKENS])[0]).max()
    notes, compared, worst = [], 0, 0.0
    for seed, length in PROMPTS:
        prompt = np.random.default_rng(seed).integers(3, 250, length).tolist()
        steps = list(generate_step(mx.array(prompt), oracle, max_tokens=STEPS, sampler=argmax))
        want = [int(t) for t, _ in steps]
        reply = llamacpp(path, prompt, STEPS, n_probs=1)
        got = reply["tokens"]
        probs = reply["completion_probabilities"]  # fewer when llama.cpp stopped at </s>
        for (token, logprobs), step in zip(steps, probs, strict=False):
            if step["id"] != int(token):
                break  # from here on they condition on different tokens
            worst = max(worst, abs(step["logprob"] - float(logprobs[int(token)])))
        eos = CASES[name]["vocab_size"] - 1  # the vocabulary's </s>: a token like the others
        if reply["stop_type"] == "eos" and got[-1:] != [eos]:
            got.append(eos)
        compared += len(got)
        if got == want[: len(got)]:
            continue
        k = next(i for i in range(len(got)) if got[i] != want[i])
        prefix = prompt + want[:k]
        logits = oracle(mx.array([prefix]))[0, -1]
        logprobs = np.array(logits - mx.logsumexp(logits))
        probe = llamacpp(path, prefix, 1, n_probs=1)
        top = probe["tokens"][0]
        top_logprob = f" ({probe['completion_probabilities'][0]['logprob']:.4f})"
        tie = " (a tie)" if logprobs[want[k]] - logprobs[got[k]] < 1e-3 else ""
        notes.append(
            f"prompt of {length}{tie}: parts at token {k} (llama.cpp {got[k]}, mlx-lm {want[k]}, "
            f"mlx-lm's margin {logprobs[want[k]] - logprobs[got[k]]:.4f} nats); llama.cpp's "
            f"prefill of the prefix: top {top}{top_logprob}, mlx-lm: {want[k]} "
            f"({logprobs[want[k]]:.4f})"
        )
    head = f"mlxserve's logits on the file within {ours:.1e} of mlx-lm's; llama.cpp: "
    if notes:
        return head + "; ".join(notes)
    return head + f"equal ({compared} tokens; their log-probs differ by at most {worst:.1e})"


def argmax(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"some of {', '.join(sorted(CASES))}")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - CASES.keys())
    if unknown:
        parser.error(f"unknown cases {unknown}; the cases are {sorted(CASES)}")
    if not (bin_dir() / "llama-server").exists():
        sys.exit(f"no llama-server in {bin_dir()}: python -m mlxserve.cli.bench.llamacpp builds it")
    print(f"{len(PROMPTS)} prompts x {STEPS} greedy tokens, llama-server vs mlx-lm")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases or sorted(CASES):
            workdir = Path(tmp) / name
            workdir.mkdir()
            try:
                print(f"{name}: {check(name, workdir)}", flush=True)
            except RuntimeError as e:
                print(f"{name}: {e}", flush=True)


if __name__ == "__main__":
    main()
