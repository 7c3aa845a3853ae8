"""mlx-lm's offline numbers, in a process of their own (so its BLAS is what mlx-lm gets).

    python mlxserve/cli/bench/mlx_lm_worker.py SPEC.json OUT.json

SPEC: {"model": DIR, "decode_prompt": ids, "decode_tokens": n, "prefill_prompt": ids,
"batches": {"8": [ids...], ...}, "batch_tokens": n, "kv_lengths": [n...]}. Runs what a user
of mlx-lm would: ``generate_step`` (the loop under ``stream_generate``) for one request and
``batch_generate`` for batches, greedy, EOS ignored so every request makes all its tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def kv_bytes(model, length: int) -> int:
    """Bytes of mlx-lm's KV cache after a prompt of ``length`` tokens (measured)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.zeros((1, length), dtype=mx.int32), cache=cache)
    arrays = [a for c in cache for a in (c.keys, c.values) if a is not None]
    mx.eval(arrays)
    return sum(a.nbytes for a in arrays)  # allocated, not only the filled part


def main(spec_path: str, out_path: str) -> None:
    if os.environ.get("BENCH_BIND_BLAS"):  # "mlx-lm+openblas": mlxserve's BLAS binding only
        from mlxserve import settings

        settings.start()  # binds the BLAS MLXSERVE_BLAS names
    import mlx.core as mx
    from mlx_lm import batch_generate, load
    from mlx_lm.generate import generate_step

    spec = json.loads(open(spec_path).read())
    model, tokenizer = load(spec["model"])
    res: dict[str, object] = {"device": str(mx.default_device()), "mlx": mx.__version__}

    def one(ids: list[int], n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = None
        count = 0
        for _tok, _ in generate_step(mx.array(ids), model, max_tokens=n):
            count += 1
            if first is None:
                first = time.perf_counter()
        assert count == n, (count, n)
        return first - t0, time.perf_counter() - first

    one(spec["decode_prompt"], 8)  # warm up
    ttft, rest = one(spec["decode_prompt"], spec["decode_tokens"])
    res["decode_tok_s"] = (spec["decode_tokens"] - 1) / rest
    print(f"[mlx-lm] single-stream decode: {res['decode_tok_s']:.1f} tok/s", flush=True)
    if spec.get("prefill_prompt"):
        ttft, _ = one(spec["prefill_prompt"], 1)
        res["prefill_tok_s"] = len(spec["prefill_prompt"]) / ttft
        print(f"[mlx-lm] prefill: {res['prefill_tok_s']:.1f} tok/s", flush=True)
    # batch_generate stops at the tokenizer's EOS ids: hide them to make every token.
    no_eos = SimpleNamespace(eos_token_ids=[], decode=tokenizer.decode)
    for n, prompts in spec.get("batches", {}).items():
        t0 = time.perf_counter()
        out = batch_generate(
            model, no_eos, prompts, max_tokens=spec["batch_tokens"], return_token_ids=True
        )
        wall = time.perf_counter() - t0
        tokens = sum(len(t) for t in out.token_ids)
        res[f"batch{n}_tok_s"] = tokens / wall
        res[f"batch{n}_tokens"] = tokens
        print(f"[mlx-lm] batch {n}: {res[f'batch{n}_tok_s']:.1f} tok/s", flush=True)
    if spec.get("kv_lengths"):
        res["kv_bytes"] = {str(n): kv_bytes(model, n) for n in spec["kv_lengths"]}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    # Run by its path: its folder (the bench package's modules: report, memory, ...) must
    # not stand in for top-level modules of the same names.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    main(sys.argv[1], sys.argv[2])
