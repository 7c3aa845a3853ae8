"""Float vs int8 activations end to end, interleaved in one process (fair on a busy machine).

    PYTHONPATH=. python bench/float_vs_int8.py [--rounds 3]

Loads the default model twice (MLXSERVE_CPU_INT8=off, then =on; the setting is read when a
model loads) and alternates the two on each case per round: prefill of a 512-token prompt
(one output token), single-stream decode (64 tokens), batches of 8 and 32 prompts x 32
tokens. Prints the best tok/s of each; bench/run.py measures the same cases one engine
after the other, against other engines.
"""

from __future__ import annotations

import argparse
import os
import time

from mlxserve import LLM, SamplingParams
from mlxserve.cli.bench import make_prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    llms = {}
    for mode in ("off", "on"):
        os.environ["MLXSERVE_CPU_INT8"] = mode
        llms[mode] = LLM(enable_prefix_caching=False)
    tok = llms["off"].get_tokenizer()
    cases = {  # name: (prompts, output tokens)
        "prefill 512": (make_prompts(tok, 1, 512, start=500), 1),
        "decode 1 x 64": (make_prompts(tok, 1, 16, start=7), 64),
        "batch 8 x 32": (make_prompts(tok, 8, 32, start=20), 32),
        "batch 32 x 32": (make_prompts(tok, 32, 32, start=40), 32),
    }
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name, (prompts, n) in cases.items():
            for mode, llm in llms.items():
                params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                t = time.perf_counter()
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
                )
                dt = time.perf_counter() - t
                tokens = (
                    len(prompts[0]) if n == 1 else sum(len(o.outputs[0].token_ids) for o in outs)
                )
                best[name, mode] = max(best.get((name, mode), 0.0), tokens / dt)
    print(f"| tok/s (best of {args.rounds}) | float | int8 | int8 / float |")
    print("|---|---:|---:|---:|")
    for name in cases:
        f, i = best[name, "off"], best[name, "on"]
        print(f"| {name} | {f:.1f} | {i:.1f} | {i / f:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
