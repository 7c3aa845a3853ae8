"""mlx-lm's side of bench/zoo_vs_mlx_lm.py, in a process of its own (stock BLAS by default).

    python bench/peers/mlx_lm_zoo_worker.py SPEC.json OUT.json

SPEC is bench/zoo_vs_mlx_lm.py's ``make_spec``; its cases run through ``run_cases``,
which that script uses for mlxserve too (this module imports nothing of mlxserve, so
mlx-lm keeps its stock BLAS). One prompt runs through ``generate_step`` (the loop under
``mlx_lm.generate``), more through ``batch_generate``. Greedy, EOS hidden so every request
makes all its tokens. OUT: per case the best prefill and whole-run walls and the token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace


def run_cases(spec: dict, run, engine: str) -> dict:
    """Every case of ``spec`` through ``run(prompts, max_tokens) -> (wall, token ids)``:
    per case the prefill and whole-run walls of each round, and every round's tokens."""
    res = {}
    for case in spec["cases"]:
        prefills, walls, tokens = [], [], []
        for r in case["rounds"]:
            prefills.append(run(r["prefill"], 1)[0])
            wall, ids = run(r["decode"], case["tokens"])
            walls.append(wall)
            tokens += ids
        res[case["name"]] = {"prefill_s": prefills, "wall_s": walls, "token_ids": tokens}
        print(f"[{engine}] {case['name']}: {min(walls):.2f} s", flush=True)
    return res


def main(spec_path: str, out_path: str) -> None:
    if os.environ.get("BENCH_BIND_BLAS"):  # "mlx-lm+openblas": mlxserve's BLAS binding only
        from mlxserve import settings

        settings.start()  # binds the BLAS MLXSERVE_BLAS names
    import mlx.core as mx
    from mlx_lm import batch_generate, load
    from mlx_lm.generate import generate_step

    spec = json.loads(open(spec_path).read())
    model, tokenizer = load(spec["model"])
    # batch_generate stops at the tokenizer's EOS ids: hide them to make every token.
    no_eos = SimpleNamespace(eos_token_ids=[], decode=tokenizer.decode)
    res: dict[str, object] = {"device": str(mx.default_device()), "mlx": mx.__version__}

    def run(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        if len(prompts) == 1:
            tokens = [[int(t) for t, _ in generate_step(mx.array(prompts[0]), model, max_tokens=n)]]
        else:
            out = batch_generate(model, no_eos, prompts, max_tokens=n, return_token_ids=True)
            tokens = out.token_ids
        wall = time.perf_counter() - t0
        assert all(len(t) == n for t in tokens), [len(t) for t in tokens]
        return wall, tokens

    run(spec["warmup"], 4)
    run(spec["warmup"][:1], 4)
    res.update(run_cases(spec, run, "mlx-lm"))
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
