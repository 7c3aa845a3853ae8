"""Offline throughput: the same prompts through LLM.generate and mlx-lm's batch_generate.

    PYTHONPATH=. python bench/offline_throughput.py                  # 32 prompts x 32 tokens
    PYTHONPATH=. python bench/offline_throughput.py MODEL --num-prompts 8 --max-tokens 64

One run, same weights (mlx-lm gets MODEL converted by `mlxserve convert`, scales in
float32), same token ids, greedy, EOS ignored. mlx-lm runs in its own process with MLX's
stock BLAS (--mlx-lm-openblas: with the OpenBLAS mlxserve binds, and float32 weights).
Prints tok/s for both and the ratio. bench/run.py includes this as "batch N".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    STOCK_ENV,
    find_openblas,
    mlx_lm_model,
    openblas_env,
    run_mlx_lm_offline,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mlx-lm-openblas", action="store_true")
    args = p.parse_args(argv)

    from mlxserve import LLM, SamplingParams
    from mlxserve.cli.bench import make_prompts

    llm = LLM(args.model, max_num_seqs=max(64, args.num_prompts))
    tok = llm.get_tokenizer()
    prompts = make_prompts(tok, args.num_prompts, args.prompt_tokens, start=7000)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids in prompts[:2]], params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ours = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    print(f"mlxserve LLM.generate: {ours:.1f} tok/s ({args.num_prompts} x {args.max_tokens})")

    variant, env = "q", STOCK_ENV
    if args.mlx_lm_openblas:
        variant, env = "f32", openblas_env(find_openblas())
    work = Path(tempfile.mkdtemp(prefix="offline-throughput-"))
    spec = {
        "model": str(mlx_lm_model(args.model, variant)),
        "decode_prompt": prompts[0],
        "decode_tokens": 2,
        "batches": {str(args.num_prompts): prompts},
        "batch_tokens": args.max_tokens,
    }
    theirs = run_mlx_lm_offline(spec, env, work, "mlx-lm")[f"batch{args.num_prompts}_tok_s"]
    print(f"mlx-lm batch_generate: {theirs:.1f} tok/s")
    print(f"ratio mlxserve / mlx-lm: {ours / theirs:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
