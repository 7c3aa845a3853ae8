"""Tensor-parallel runs for tests/test_tensor_parallel.py, each in a fresh process
(MLX has one distributed group per process): ``python -m tests.tp_script MODE MODEL TP``.

    scenario  the batching / chunked prefill / prefix caching / preemption workload,
              printed as one JSON line (tokens and the scheduler counters)
    chat      greedy replies to two conversations (MODEL "" is the default model)
    spec      the scenario's generations with n-gram speculative decoding (drafts verified
              as decode rows on every rank), plus the speculation counters
    kill      print the ranks' pids, then generate until a rank is killed from outside;
              print how the engine failed and whether the ranks are gone
"""

from __future__ import annotations

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
    }


# Short: on 2 shared cores a step of 3 ranks of SmolLM2 takes ~1 s (bench/README.md).
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


def run_chats(llm: LLM) -> list[list[int]]:
    """Greedy replies (8 tokens) to two conversations, batched."""
    params = SamplingParams(temperature=0, max_tokens=8)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, params, use_tqdm=False)]


SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def run_spec(llm: LLM) -> dict[str, Any]:
    """The scenario's greedy outputs (speculating if ``llm`` does) and its draft counters."""
    prompts = scenario_prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    return {
        "tokens": [o.outputs[0].token_ids for o in out],
        "accepted": stats.spec_decode_num_accepted_tokens,
    }


def kill(model: str, tp: int) -> None:
    llm = LLM(model, tensor_parallel_size=tp, dtype="float32", num_blocks=256)
    ranks = llm.engine.ranks
    print("RANKS", json.dumps([p.pid for p in ranks.procs]), flush=True)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 120:
            llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        print("NO ERROR", flush=True)
    except Exception as e:  # noqa: BLE001 -- reported to the test
        gone = all(p.poll() is not None for p in ranks.procs)
        print("ERROR", json.dumps({"type": type(e).__name__, "message": str(e), "gone": gone}))


def main(argv: list[str]) -> None:
    mode, model, tp = argv[0], argv[1], int(argv[2])
    if mode == "scenario":
        llm = LLM(model, tensor_parallel_size=tp, **SCENARIO_ARGS)
        print("RESULT", json.dumps(run_scenario(llm)), flush=True)
        llm.shutdown()
    elif mode == "spec":
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            speculative_config=SPEC,
            kv_cache_dtype="int8",
            **SCENARIO_ARGS,
        )
        print("RESULT", json.dumps(run_spec(llm)), flush=True)
        llm.shutdown()
    elif mode == "chat":  # MODEL "" is the embedded default model
        llm = LLM(model or None, tensor_parallel_size=tp, num_blocks=64)
        print("RESULT", json.dumps(run_chats(llm)), flush=True)
        llm.shutdown()
    elif mode == "kill":
        kill(model, tp)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
