"""N-gram speculative decoding vs plain decoding, same model, same prompts, one run.

    PYTHONPATH=. python bench/spec_decode.py                       # SmolLM2, code edit + chat
    PYTHONPATH=. python bench/spec_decode.py MODEL --max-tokens 128 --batch 32

Workloads (greedy, one stream each unless --batch):
- edit: a ~1,500-token Python file (mlxserve's own block pool, cut at a line boundary)
  and the instruction to return it with one function renamed. A model that follows it
  copies most of its prompt, which n-gram drafts predict.
- repeat: "repeat this text exactly" with ~400 tokens of prose (the README's opening):
  the best case, for a model too small to follow the edit instruction.
- chat: a short question with nothing to copy.
- batch: --batch different short chat prompts at once (0: skip), where the batch-size
  back-off (``disable_by_batch_size``) should turn speculation off.

With --repeat N the engines run alternately N times each and the best run of each is
reported (the machine's load drifts). Reported per workload and engine: output tokens,
decode tok/s (tokens after the first / time after the first), end-to-end seconds, engine
steps, drafted and accepted tokens and the acceptance rate, and whether the speculative
output equals the plain one token for token (it must: greedy verification).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
EDIT_SOURCE = ROOT / "mlxserve" / "core" / "block_pool.py"
EDIT_TOKENS = 1500
CHAT = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "What are three tips for learning a new language?",
    "Describe how a bicycle works.",
]


def edit_prompt(tokenizer) -> str:
    """The code-editing request: ~EDIT_TOKENS tokens of source, one rename asked."""
    lines, text = EDIT_SOURCE.read_text().splitlines(keepends=True), ""
    for line in lines:
        if len(tokenizer.encode(text + line)) > EDIT_TOKENS:
            break
        text += line
    ask = (
        "Here is a Python file. Return the whole file unchanged, except rename the method "
        "`get_new_blocks` to `allocate_blocks` everywhere. Output only the code.\n\n"
    )
    return chat(tokenizer, ask + "```python\n" + text + "```")


def repeat_prompt(tokenizer) -> str:
    """Copy ~400 tokens of prose: the most an n-gram proposer can predict."""
    text = ""
    for para in (ROOT / "README.md").read_text().split("\n\n"):
        if len(tokenizer.encode(text + para)) > 400:
            break
        text += para + "\n\n"
    return chat(tokenizer, "Repeat the following text exactly, word for word:\n\n" + text)


def chat(tokenizer, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run(llm, prompts: list[str], params) -> dict:
    """Generate; timing from the request metrics, steps and draft counts from the engine."""
    engine = llm.engine
    before = engine.get_stats()
    steps = 0
    step = engine.step

    def counting_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        return step(*args, **kwargs)

    engine.step = counting_step
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.step = step
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {
        "output_tokens": tokens,
        "decode_tok_s": (tokens - len(outs)) / max(last - first, 1e-9),
        "seconds": wall,
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "text": outs[0].outputs[0].text,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="also a batch of N chat prompts")
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--repeat", type=int, default=1, help="runs per engine (best reported)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    import mlx.core as mx

    from mlxserve import LLM, SamplingParams

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=spec)}
    tok = engines["plain"].get_tokenizer()
    workloads = {}
    for name in args.workloads.split(","):
        if name == "edit":
            workloads["edit"] = [edit_prompt(tok)]
        elif name == "repeat":
            workloads["repeat"] = [repeat_prompt(tok)]
        elif name == "chat":
            workloads["chat"] = [chat(tok, CHAT[0])]
    if args.batch:
        workloads[f"batch{args.batch}"] = [
            chat(tok, f"{CHAT[i % len(CHAT)]} (#{i})") for i in range(args.batch)
        ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"device {mx.default_device()}, speculative_config {json.dumps(spec)}")
    for llm in engines.values():  # warm-up: kernels, the pool's first blocks
        llm.generate([chat(tok, "Hi")], SamplingParams(max_tokens=4), use_tqdm=False)
    results = {}
    for wname, prompts in workloads.items():
        num_prompt = [len(tok.encode(p)) for p in prompts]
        print(f"\n{wname}: {len(prompts)} prompt(s) of {min(num_prompt)}..{max(num_prompt)} tokens")
        # Alternating runs, the best of each engine: the machine's load drifts.
        row: dict[str, dict] = {}
        for _ in range(args.repeat):
            for name, llm in engines.items():
                r = run(llm, prompts, params)
                if name not in row or r["decode_tok_s"] > row[name]["decode_tok_s"]:
                    row[name] = r
        same = row["ngram"]["token_ids"] == row["plain"]["token_ids"]
        for name, r in row.items():
            acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
            print(
                f"  {name:6s} {r['output_tokens']:5d} tokens  decode {r['decode_tok_s']:6.1f} tok/s"
                f"  {r['seconds']:6.1f} s  {r['steps']:4d} steps  drafted {r['drafted']:5d}"
                f"  accepted {r['accepted']:5d} ({acc})"
            )
        speedup = row["ngram"]["decode_tok_s"] / row["plain"]["decode_tok_s"]
        print(f"  speedup {speedup:.2f}x, same tokens: {same}")
        print(f"  output starts: {row['plain']['text'][:160]!r}")
        results[wname] = {
            "speedup": speedup,
            "same_tokens": same,
            **{n: {k: v for k, v in r.items() if k != "token_ids"} for n, r in row.items()},
        }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
