"""Do int8 activations (MLXSERVE_CPU_INT8) track llama.cpp as well as float ones do?

    PYTHONPATH=. python bench/int8_agreement.py [--prompts 16] [--tokens 48] [--json out.json]

On the default model (SmolLM2-135M Q4_1), each mode in a fresh process (the setting is
read when the model loads): ``float`` (MLXSERVE_CPU_INT8=off) and ``int8`` (=on).

1. Against llama.cpp (tests/fixtures/smollm2-llamacpp.json: 6 prompts x 16 greedy steps,
   with its top-3 logprobs; llama.cpp itself rounds activations to 8 bits):
   - free-running: our greedy tokens (decode rows, one request at a time) equal to
     llama.cpp's before the first difference, and in total;
   - teacher-forced: the prompt plus llama.cpp's tokens fed 2-4 tokens per step (chunked
     prefill, so every row goes through the decode-row kernels), our argmax
     vs llama.cpp's token at every step and at its clear steps (top-2 gap > 0.3 nats),
     and the mean |our logprob - llama.cpp's| of its token.
2. int8 vs float on ``--prompts`` synthetic prompts x ``--tokens`` greedy tokens: how
   many sequences are equal, and where the others first differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT / "tests" / "fixtures" / "smollm2-llamacpp.json"
MODES = {"float": "off", "int8": "on"}
CLEAR_GAP = 0.3


def worker(num_prompts: int, max_tokens: int) -> dict:
    from mlxserve import LLM, SamplingParams
    from mlxserve.cli.bench.workload import make_prompts

    cases = json.loads(ORACLE.read_text())["greedy"]
    # A few prompt tokens per step (2-4 rows: the decode-row kernels). The chunk size is
    # chosen so that the last chunk is not one token: this engine then loses the prompt
    # logprobs (noticed here, see bench/README.md).
    engines: dict[int, LLM] = {}

    def chunked(total: int) -> LLM:
        c = next(c for c in (2, 3, 4) if total % c != 1)
        if c not in engines:
            engines[c] = LLM(
                None, max_num_batched_tokens=c, enable_prefix_caching=False, num_blocks=64
            )
        return engines[c]

    free, forced = [], []
    for case in cases:
        steps = case["steps"]
        params = SamplingParams(temperature=0.0, max_tokens=len(steps), ignore_eos=True)
        llm = chunked(len(case["prompt_ids"]) + len(steps))
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, params, use_tqdm=False)[0]
        free.append(out.outputs[0].token_ids)
        ids = case["prompt_ids"] + [s["id"] for s in steps]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        rows = out.prompt_logprobs[len(case["prompt_ids"]) :]  # position i: token ids[i]
        forced.append(
            [
                {
                    "argmax": max(row, key=lambda t: row[t]),
                    "logprob": row.get(s["id"]),
                }
                for row, s in zip(rows, steps, strict=True)
            ]
        )
    llm = LLM(None, max_num_seqs=max(64, num_prompts))
    prompts = make_prompts(llm.get_tokenizer(), num_prompts, 24, start=3000)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = [
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
        for ids in prompts
    ]
    return {"free": free, "forced": forced, "alone": alone}


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def score(cases: list[dict], out: dict) -> dict:
    prefix = total = steps = hits = clear = clear_hits = 0
    errors = []
    for case, free, forced in zip(cases, out["free"], out["forced"], strict=True):
        want = [s["id"] for s in case["steps"]]
        d = first_diff(want, free)
        prefix += len(want) if d is None else d
        total += sum(a == b for a, b in zip(want, free, strict=True))
        for s, f in zip(case["steps"], forced, strict=True):
            steps += 1
            hits += f["argmax"] == s["id"]
            if s["top"][0][1] - s["top"][1][1] > CLEAR_GAP:
                clear += 1
                clear_hits += f["argmax"] == s["id"]
            if f["logprob"] is not None:
                errors.append(abs(f["logprob"] - s["logprob"]))
    return {
        "free_prefix": prefix,
        "free_equal": total,
        "steps": steps,
        "forced_argmax": hits,
        "clear_steps": clear,
        "clear_argmax": clear_hits,
        "logprob_mae": sum(errors) / len(errors),
        "logprob_max": max(errors),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.prompts, args.tokens)))
        return 0
    cases = json.loads(ORACLE.read_text())["greedy"]
    outs, scores = {}, {}
    for name, setting in MODES.items():
        cmd = [sys.executable, __file__, "--worker", "--prompts", str(args.prompts)]
        cmd += ["--tokens", str(args.tokens)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), MLXSERVE_CPU_INT8=setting)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        outs[name] = json.loads(done.stdout.strip().splitlines()[-1])
        scores[name] = score(cases, outs[name])
        s = scores[name]
        print(
            f"[{name}] vs llama.cpp: free-running {s['free_prefix']}/{s['steps']} tokens before "
            f"the first difference, {s['free_equal']}/{s['steps']} equal; teacher-forced argmax "
            f"{s['forced_argmax']}/{s['steps']} (clear steps {s['clear_argmax']}/"
            f"{s['clear_steps']}); |logprob - llama.cpp's| mean {s['logprob_mae']:.4f} "
            f"max {s['logprob_max']:.4f}",
            flush=True,
        )
    diffs = [
        first_diff(a, b) for a, b in zip(outs["float"]["alone"], outs["int8"]["alone"], strict=True)
    ]
    same = sum(d is None for d in diffs)
    where = sorted(d for d in diffs if d is not None)
    print(
        f"int8 vs float, {len(diffs)} prompts x {args.tokens} tokens: {same} equal; "
        f"first differences at {where}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"scores": scores, "int8_vs_float": diffs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
