"""mlx-lm's side of bench/zoo_vs_mlx_lm.py, in a process of its own (stock BLAS by default).

    python bench/peers/mlx_lm_zoo_worker.py SPEC.json OUT.json

SPEC: {"model": DIR, "warmup": [ids...], "single": {"prefill": ids, "decode": ids, "tokens": n},
"batches": [{"name": str, "prefill": [ids...], "decode": [ids...], "tokens": n}]}.
Single stream runs ``generate_step`` (the loop under ``mlx_lm.generate``); batches run
``batch_generate``. Greedy, EOS hidden so every request makes all its tokens. Each timed
case runs twice on different prompts: with 1 output token (the prefill time) and with
``tokens`` (the whole run); OUT has the walls, mlx-lm's own BatchStats and the token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace


def main(spec_path: str, out_path: str) -> None:
    if os.environ.get("BENCH_BIND_BLAS"):  # "mlx-lm+openblas": mlxserve's BLAS binding only
        from mlxserve import blas

        blas.preload()
    import mlx.core as mx
    from mlx_lm import batch_generate, load
    from mlx_lm.generate import generate_step

    spec = json.loads(open(spec_path).read())
    model, tokenizer = load(spec["model"])
    # batch_generate stops at the tokenizer's EOS ids: hide them to make every token.
    no_eos = SimpleNamespace(eos_token_ids=[], decode=tokenizer.decode)
    res: dict[str, object] = {"device": str(mx.default_device()), "mlx": mx.__version__}

    def single(ids: list[int], n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        tokens = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
        assert len(tokens) == n, (len(tokens), n)
        return time.perf_counter() - t0, tokens

    def batch(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], object]:
        t0 = time.perf_counter()
        out = batch_generate(model, no_eos, prompts, max_tokens=n, return_token_ids=True)
        return time.perf_counter() - t0, out.token_ids, out.stats

    batch(spec["warmup"], 4)
    single(spec["warmup"][0], 4)
    s = spec["single"]
    prefill, _ = single(s["prefill"], 1)
    wall, tokens = single(s["decode"], s["tokens"])
    res["single"] = {"prefill_s": prefill, "wall_s": wall, "token_ids": [tokens]}
    print(f"[mlx-lm] single stream: {wall:.2f} s", flush=True)
    for b in spec["batches"]:
        prefill, _, pstats = batch(b["prefill"], 1)
        wall, token_ids, stats = batch(b["decode"], b["tokens"])
        res[b["name"]] = {
            "prefill_s": prefill,
            "wall_s": wall,
            "token_ids": token_ids,
            "own_prompt_s": stats.prompt_time,
            "own_generation_tps": stats.generation_tps,
        }
        print(f"[mlx-lm] {b['name']}: {wall:.2f} s", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
