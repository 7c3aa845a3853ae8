"""Quantized KV cache (--kv-cache-dtype) vs the float cache: capacity, speed, accuracy.

    PYTHONPATH=. python bench/kv_cache_dtype.py                 # SmolLM2, 64 MiB of KV
    PYTHONPATH=. python bench/kv_cache_dtype.py MODEL --kv-budget-mb 256 --length 2048

For each kv_cache_dtype (auto = the activation dtype, int8), one engine with the same
model and a fixed KV budget (``kv_cache_memory_bytes``) reports, in one run:
- capacity: the blocks the planner gives that budget, and how many requests of --length
  tokens fit at once (blocks / blocks per request);
- decode tok/s: --batch short greedy requests of --decode-tokens tokens each (after the
  first token: the decode phase);
- accuracy: greedy outputs of --prompts chat prompts x --tokens tokens, compared with the
  float cache's token for token (positions equal before the first difference, and
  sequences identical).
int4 is not an engine setting (it is refused; see README): its accuracy is measured here by
simulation, K/V rounded in a float pool before the write, in two formats: ours
(symmetric, a scale per token and head, max|x| / 7) and mlx-lm's kv_bits=4 (affine, a scale
and bias per 64 values, MLX's own quantizer); capacity is computed from the row size. For
reference the same simulation runs a float16 cache and mlx-lm's kv_bits=8 (greedy
agreement of a float32 engine with those: how much any rounding of K/V moves the tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHAT = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "What are three tips for learning a new language?",
    "Describe how a bicycle works.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for pancakes.",
]


def fake_int4_symmetric(x):
    """4-bit, symmetric, one float32 scale per (token, head) row: max|x| / 7."""
    import mlx.core as mx

    xf = x.astype(mx.float32)
    step = mx.abs(xf).max(axis=-1, keepdims=True) / 7
    safe = mx.where(step > 0, step, 1.0)
    return (mx.clip(mx.round(xf / safe), -7, 7) * step).astype(x.dtype)


def fake_affine(bits: int) -> Callable:
    """K/V as mlx-lm's kv_bits stores them: MLX's affine quantizer, groups of 64."""

    def rounded(x):
        import mlx.core as mx

        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        group = 64 if flat.shape[-1] % 64 == 0 else 32
        w, s, b = mx.quantize(flat, group_size=group, bits=bits)
        out = mx.dequantize(w, s, b, group_size=group, bits=bits)
        return out.reshape(x.shape).astype(x.dtype)

    return rounded


def fake_float16(x):
    """A float16 cache (K/V rounded to float16), for reference next to a float32 one."""
    import mlx.core as mx

    return x.astype(mx.float16).astype(x.dtype)


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy agreement: mean fraction of positions before the first difference, and
    how many sequences are identical."""
    prefix = []
    for a, b in zip(reference, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        prefix.append(n / max(len(a), 1))
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    return {
        "agreement": round(sum(prefix) / len(prefix), 3),
        "identical": f"{same}/{len(reference)}",
    }


def greedy(llm, prompts: list[str], tokens: int) -> list[list[int]]:
    from mlxserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def decode_rate(llm, prompts: list[str], tokens: int) -> float:
    """Decode tok/s of one batch: tokens after each request's first / time after the first."""
    from mlxserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    produced = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return produced / max(last - first, 1e-9)


def with_fake_kv(transform: Callable, run: Callable):
    """run() with every pool write rounding K/V through `transform` (a simulation)."""
    from mlxserve.ops import fallback

    write = fallback.write_kv

    def rounded(k_cache, v_cache, keys, values, slots):
        return write(k_cache, v_cache, transform(keys), transform(values), slots)

    fallback.write_kv = rounded
    try:
        return run()
    finally:
        fallback.write_kv = write


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--dtype", default="auto", help="activation dtype (auto: float32 on CPU)")
    p.add_argument("--kv-budget-mb", type=int, default=64, help="KV cache budget (MiB)")
    p.add_argument("--length", type=int, default=1024, help="tokens per request (capacity)")
    p.add_argument("--prompts", type=int, default=6, help="chat prompts for the greedy check")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--batch", type=int, default=8, help="requests in the decode-rate batch")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode request")
    p.add_argument("--no-simulated", action="store_true", help="skip the simulated formats")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(CHAT):
        p.error(f"--prompts must be in [1, {len(CHAT)}], got {args.prompts}")

    from mlxserve import LLM
    from mlxserve.kv_cache_spec import KV_SCALE_BYTES
    from mlxserve.utils import cdiv

    budget = args.kv_budget_mb * 2**20
    results: dict = {
        "budget_mib": args.kv_budget_mb,
        "length": args.length,
        "dtype": args.dtype,
        "dtypes": {},
    }
    greedy_tokens: dict[str, list[list[int]]] = {}
    prompts = CHAT[: args.prompts]
    batch = [CHAT[i % len(CHAT)] + f" (#{i})" for i in range(args.batch)]
    engine = None
    for dtype in ("auto", "int8"):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=dtype,
            kv_cache_memory_bytes=budget,
            max_model_len=args.length,
            max_num_seqs=1024,  # the budget, not the batch cap, limits the blocks
            enable_prefix_caching=False,  # every run writes (and rounds) its own K/V
        )
        engine = llm.engine
        plan = engine.plan
        chat = [
            llm.get_tokenizer().apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
            for t in prompts
        ]
        per_request = cdiv(args.length, plan.block_size)
        t0 = time.perf_counter()
        greedy_tokens[dtype] = greedy(llm, chat, args.tokens)
        greedy_s = time.perf_counter() - t0
        rate = decode_rate(llm, batch, args.decode_tokens)
        results["dtypes"][dtype] = {
            "pool": plan.kv_dtype,
            "bytes_per_block": plan.bytes_per_block,
            "blocks": plan.num_blocks - 1,
            "requests_that_fit": (plan.num_blocks - 1) // per_request,
            "decode_tok_s": round(rate, 1),
            "greedy_seconds": round(greedy_s, 1),
        }
        print(f"[{dtype}] {json.dumps(results['dtypes'][dtype])}", flush=True)
        if dtype == "auto":  # kept for the simulated formats
            float_llm, float_chat = llm, chat
    results["dtypes"]["int8"].update(compare(greedy_tokens["auto"], greedy_tokens["int8"]))
    if not args.no_simulated:
        layout, block_size = engine.runner.layout, engine.plan.block_size
        formats = {  # name -> (rounding, bytes of a row of d values)
            "float16 (reference)": (fake_float16, lambda d: 2 * d),
            # float16 scale and bias per 64 values, as mlx-lm keeps them on a Mac
            "int8-affine-g64 (mlx-lm kv_bits=8)": (fake_affine(8), lambda d: d + 4 * cdiv(d, 64)),
            "int4-sym-row": (fake_int4_symmetric, lambda d: d // 2 + KV_SCALE_BYTES),
            "int4-affine-g64 (mlx-lm kv_bits=4)": (
                fake_affine(4),
                lambda d: d // 2 + 4 * cdiv(d, 64),
            ),
        }
        for name, (transform, row) in formats.items():
            tokens = with_fake_kv(transform, lambda: greedy(float_llm, float_chat, args.tokens))
            per_block = sum(block_size * h * (row(k) + row(v)) for h, k, v in layout.tensor_shapes)
            blocks = budget // per_block
            results["dtypes"][name] = {
                "simulated": True,
                "bytes_per_block": per_block,
                "blocks": blocks,
                "requests_that_fit": blocks // cdiv(args.length, block_size),
                **compare(greedy_tokens["auto"], tokens),
            }
            print(f"[{name}] {json.dumps(results['dtypes'][name])}", flush=True)
    results["dtypes"]["auto"].update(agreement=1.0, identical=f"{args.prompts}/{args.prompts}")
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
