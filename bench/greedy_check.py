"""Do the CPU speed settings change greedy outputs? Same prompts, every setting, compared.

    PYTHONPATH=. python bench/greedy_check.py [MODEL] [--num-prompts 16] [--max-tokens 48]

Each setting runs in a fresh process (BLAS choices are made before MLX loads):

    stock      MLXSERVE_BLAS=off: MLX's bundled BLAS, quantized layers as loaded
    openblas   OpenBLAS, quantized layers dequantized to float32, plain sgemm
    default    OpenBLAS + the one-row sgemm -> sgemv shim (what mlxserve does by default)

and generates greedily for every prompt alone (one request at a time) and all batched.
Prints, per setting and mode, how many sequences equal the "stock / alone" reference and
where the first differing token is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "stock": {"MLXSERVE_BLAS": "off"},
    "openblas": {"MLXSERVE_BLAS_GEMV": "off"},
    "default": {},
}


def generate(model: str | None, num_prompts: int, max_tokens: int) -> dict[str, list]:
    from mlxserve import LLM, SamplingParams
    from mlxserve.cli.bench import make_prompts

    llm = LLM(model, max_num_seqs=max(64, num_prompts))
    prompts = make_prompts(llm.get_tokenizer(), num_prompts, 24, start=3000)
    items = [{"prompt_token_ids": ids} for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = [llm.generate(item, params, use_tqdm=False)[0] for item in items]
    batched = llm.generate(items, params, use_tqdm=False)
    return {
        "alone": [o.outputs[0].token_ids for o in alone],
        "batched": [o.outputs[0].token_ids for o in batched],
    }


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(generate(args.model, args.num_prompts, args.max_tokens)))
        return 0
    outs = {}
    for name, env in SETTINGS.items():
        cmd = [sys.executable, __file__, "--worker", "--num-prompts", str(args.num_prompts)]
        cmd += ["--max-tokens", str(args.max_tokens)] + ([args.model] if args.model else [])
        run_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
        done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, check=True)
        outs[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"[{name}] done", flush=True)
    ref = outs["stock"]["alone"]
    all_same = True
    for name, modes in outs.items():
        for mode, seqs in modes.items():
            diffs = [first_diff(r, s) for r, s in zip(ref, seqs, strict=True)]
            same = sum(d is None for d in diffs)
            where = sorted(d for d in diffs if d is not None)
            all_same &= same == len(ref)
            print(
                f"{name:>9} / {mode:<8} {same}/{len(ref)} identical to stock/alone"
                + (f"; first differing tokens at {where}" if where else "")
            )
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
