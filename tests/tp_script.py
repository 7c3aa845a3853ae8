"""Tensor-parallel runs for tests/test_tensor_parallel.py, each in a fresh process
(MLX has one distributed group per process)::

    python -m tests.tp_script MODE MODEL [--tp N] [--pp N] [--spec] [--then-fail]

    scenario  the batching / chunked prefill / prefix caching / preemption workload,
              printed as one JSON line (tokens and the scheduler counters); with --spec
              the engine speculates (n-gram: drafts verified as decode rows on every rank)
    chat      greedy replies to two conversations and teacher-forced log-probs of eight
              texts (MODEL "" is the default model)
    --then-fail  afterwards print the ranks' pids and generate until the test kills or
              stops a rank; print how the engine failed and whether the ranks are gone

Each spawn is expensive (2-3 processes import MLX and load a model), so one run checks
several things.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from mlxserve import LLM, SamplingParams

# Pool of 24 blocks x 4 tokens for 4 requests needing ~12 blocks each: preemption;
# a 16-token budget: prompts of 20-30 tokens prefill in chunks.
SCENARIO_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=4, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4
)


def scenario_prompts(vocab_size: int) -> list[list[int]]:
    """Four prompts; the last two share a 16-token prefix (whole blocks) with the first."""
    rng = random.Random(7)
    shared = [rng.randrange(vocab_size) for _ in range(16)]
    return [
        shared + [rng.randrange(vocab_size) for _ in range(8)],
        [rng.randrange(vocab_size) for _ in range(30)],
        shared + [rng.randrange(vocab_size) for _ in range(5)],
        shared + [rng.randrange(vocab_size) for _ in range(12)],
    ]


def run_scenario(llm: LLM) -> dict[str, Any]:
    """Greedy outputs of the scenario (run twice: the second run hits the prefix cache),
    and two prompts' embeddings (pooled hidden states, no logits)."""
    prompts = scenario_prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts[2:], params, use_tqdm=False)
    embeddings = [e.outputs.embedding for e in llm.embed(prompts[:2], use_tqdm=False)]
    stats = llm.engine.get_stats()
    return {
        "tokens": [o.outputs[0].token_ids for o in first + second],
        "embeddings": [list(map(float, e)) for e in embeddings],
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "accepted": stats.spec_decode_num_accepted_tokens,  # drafts (0 without speculation)
        # Steps that copied a KV pool array instead of writing it in place (should be none),
        # and steps writing each pool twice+ (pipeline micro-batches) that did (timing).
        "pool_copied_steps": llm.engine.runner.pool_watch.num_copied_steps,
        "pool_rewrite_copied_steps": llm.engine.runner.pool_watch.num_rewrite_copied_steps,
    }


# Short: on 2 shared cores a step of 3 ranks of SmolLM2 takes ~1 s (bench/README.md).
CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer with one word."}],
    [{"role": "user", "content": "Name the days of the week."}],
]


def run_chats(llm: LLM) -> list[list[int]]:
    """Greedy replies (8 tokens) to two conversations, batched."""
    params = SamplingParams(temperature=0, max_tokens=8)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, params, use_tqdm=False)]


# Teacher-forced texts of several kinds (prose, code, digits, SQL): every token's
# log-prob is compared, not only the greedy choice, so a split that adds in another order
# shows even where no argmax flips.
TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144",
    "The quick brown fox jumps over the lazy dog while the cat watches quietly.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
]


def run_logprobs(llm: LLM) -> list[list[float]]:
    """Each text's tokens' log-probs given the tokens before them (teacher-forced)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = []
    for o in llm.generate(TEXTS, params, use_tqdm=False):
        pairs = zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)
        out.append([entry[token] for token, entry in pairs])
    return out


# No cost back-off: it decides from wall-clock step times, and these runs compare their
# draft counts exactly.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_cost": False,
}


def fail_on_demand(llm: LLM) -> None:
    """Print the ranks' pids, then generate until the test kills or stops a rank; print
    how the engine failed and whether every rank is gone."""
    ranks = llm.engine.ranks
    print("RANKS", json.dumps([p.pid for p in ranks.procs]), flush=True)
    max_tokens = min(400, llm.engine.max_model_len - 3)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 120:
            llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        print("NO ERROR", flush=True)
    except Exception as e:  # noqa: BLE001 -- reported to the test
        gone = all(p.poll() is not None for p in ranks.procs)
        error = {"type": type(e).__name__, "message": str(e), "gone": gone}
        print("ERROR", json.dumps(error), flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("scenario", "chat"))
    parser.add_argument("model", help='"" is the embedded default model')
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--spec", action="store_true", help="n-gram speculative decoding")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--micro-batch-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--then-fail", action="store_true", help="then fail_on_demand")
    args = parser.parse_args(argv)
    parallel = dict(
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        distributed_timeout_seconds=args.timeout,
        pipeline_micro_batch_tokens=args.micro_batch_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.mode == "scenario":
        spec = dict(speculative_config=SPEC) if args.spec else {}
        llm = LLM(args.model, **parallel, **spec, **SCENARIO_ARGS)
        result = run_scenario(llm)
    else:
        llm = LLM(args.model or None, **parallel, num_blocks=64)
        result = {"chats": run_chats(llm), "logprobs": run_logprobs(llm)}
    channel = llm.engine.runner.channel
    if args.pp > 1:  # every rank's counters (worker/pipeline.py): the stages did run
        result["stage_stats"] = channel.gather_stats([])
    print("RESULT", json.dumps(result), flush=True)
    if args.then_fail:
        fail_on_demand(llm)
    else:
        llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
