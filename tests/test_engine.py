"""The engine end to end on tiny random models: batch invariance, prefix caching,
preemption, sampling, n > 1, logprobs, and argument errors."""

from __future__ import annotations

import json
import logging
import os

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT

NUM_PROMPTS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)


def prompts(n: int = NUM_PROMPTS) -> list[list[int]]:
    """Token-id prompts of varied lengths (3..60), some sharing prefixes."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 300, size=40).tolist()
    out = []
    for i in range(n):
        length = int(rng.integers(3, 60))
        if i % 4 == 0:  # a quarter start with the same 40 tokens
            out.append(shared[: min(length, 40)] + rng.integers(3, 300, size=8).tolist())
        else:
            out.append(rng.integers(3, 300, size=length).tolist())
    return out


def greedy_tokens(llm: LLM, ps: list[list[int]], one_by_one: bool = False) -> list[list[int]]:
    if one_by_one:
        return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    return [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]


def test_batch_invariance_across_batching_caching_chunking_and_preemption(tiny) -> None:
    oracle, model_dir = tiny
    ps = prompts()
    base = LLM(str(model_dir), num_blocks=512, max_num_batched_tokens=2048)
    reference = greedy_tokens(base, ps, one_by_one=True)
    # The independent oracle: mlx-lm's own greedy loop for a few of them.
    from tests.model_helpers import mlx_lm_greedy

    for i in (0, 5, 17):
        assert reference[i] == mlx_lm_greedy(oracle, ps[i], 12)[0]
    assert greedy_tokens(base, ps) == reference
    for kwargs in (
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=16),
        dict(max_num_batched_tokens=64),
        dict(max_num_batched_tokens=2048, max_num_seqs=5),
    ):
        llm = LLM(str(model_dir), num_blocks=512, **kwargs)
        assert greedy_tokens(llm, ps) == reference, kwargs
    # A pool of 24 blocks x 16 tokens cannot hold 32 running requests: preemption.
    small = LLM(str(model_dir), num_blocks=24, max_model_len=128)
    assert greedy_tokens(small, ps) == reference
    assert small.engine.scheduler.make_stats().num_preemptions > 0


def test_shared_prefix_computes_only_new_tokens(tiny) -> None:
    _, model_dir = tiny
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 300, size=1000).tolist()
    a, b = prefix + [5, 6, 7], prefix + [9, 10]
    cached = LLM(str(model_dir), num_blocks=400, block_size=16)
    first = cached.generate([a], GREEDY, use_tqdm=False)[0]
    before = cached.engine.scheduler.make_stats()
    second = cached.generate([b], GREEDY, use_tqdm=False)[0]
    after = cached.engine.scheduler.make_stats()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 1000 // 16 * 16  # every full block of the prefix
    assert after.prefix_cache_hits - before.prefix_cache_hits == 992
    uncached = LLM(str(model_dir), num_blocks=400, enable_prefix_caching=False)
    assert (
        uncached.generate([b], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        == second.outputs[0].token_ids
    )


def test_cache_stats_count_what_two_requests_shared(tiny, caplog) -> None:
    _, model_dir = tiny
    config = json.loads((model_dir / "config.json").read_text())
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 300, size=100).tolist()
    llm = LLM(str(model_dir), num_blocks=400, block_size=16)
    llm.generate([prefix + [5]], GREEDY, use_tqdm=False)
    with caplog.at_level(logging.DEBUG, logger="mlxserve"):
        llm.generate([prefix + [9, 10]], GREEDY, use_tqdm=False)
    stats = llm.engine.cache_stats()
    assert (stats.num_requests, stats.num_requests_hit) == (2, 1)
    assert (stats.query_tokens, stats.hit_tokens) == (101 + 102, 96)
    assert stats.hit_rate == 96 / 203 and stats.enabled and stats.block_size == 16
    (pool,) = stats.tiers
    assert pool.num_blocks == 399 and pool.num_blocks_in_use == 0  # both requests are done
    # Each request's K/V holds its prompt and 11 of its 12 outputs: 112 and 113 tokens, 7
    # full blocks each; the prefix's 6 are shared.
    assert pool.num_cached_blocks == 7 + 7 - 6
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    itemsize = np.dtype(str(llm.engine.runner.kv_dtype).split(".")[-1]).itemsize
    assert pool.bytes_per_block == per_token * 16 * itemsize
    assert stats.as_dict()["tiers"][0]["cached_bytes"] == 8 * pool.bytes_per_block
    # The debug log says where the second prompt left the cache: after token 96.
    assert any("96 of 102 prompt tokens cached (pool)" in r.message for r in caplog.records)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny) -> None:
    _, model_dir = tiny
    llm = LLM(str(model_dir), num_blocks=256)
    ps = prompts(6)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([ps[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 6
    mixed[2] = seeded
    batch = llm.generate(ps, mixed, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([ps[2]], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt(tiny) -> None:
    _, model_dir = tiny
    llm = LLM(str(model_dir), num_blocks=256)
    prompt = prompts(1)[0] * 3  # several full blocks
    out = llm.generate(
        [prompt],
        SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True, seed=7),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert all(len(s) == 8 for s in samples) and len(set(samples)) > 1
    stats = llm.engine.scheduler.make_stats()
    # Samples 2..4 found the first sample's full prompt blocks in the cache.
    assert stats.prefix_cache_hits >= 3 * (len(prompt) // 16 * 16)


@pytest.mark.parametrize("chunks", ["one", "last token alone"])
def test_logprobs_equal_log_softmax_of_reference_logits(tiny, chunks: str) -> None:
    """Also when the prompt's last token is a chunk of its own: the chunk before scored
    every prompt position, and the prompt logprobs went missing (None)."""
    oracle, model_dir = tiny
    prompt = prompts(2)[1]
    budget = {"one": None, "last token alone": len(prompt) - 1}[chunks]
    llm = LLM(str(model_dir), num_blocks=256, max_num_batched_tokens=budget)
    params = SamplingParams(
        temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    # Reference: mlx-lm's forward over prompt + generated tokens, then log_softmax.
    logits = np.array(oracle(mx.array([prompt + tokens]))[0].astype(mx.float32))
    shifted = logits - logits.max(-1, keepdims=True)
    ref = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    for step, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        top3 = np.argsort(-row)[:3].tolist()
        assert set(entry) == {tok, *top3}
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t], abs=1e-4)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]] == pytest.approx(ref[pos - 1][prompt[pos]], abs=1e-4)
        assert len(entry) >= 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
        (dict(block_size=0), r"block_size must be in \[1, 256\], got 0"),
        (dict(gpu_memory_utilization=1.5), r"memory_fraction .* must be in \(0, 1\], got 1.5"),
        (dict(dtype="int8"), "dtype must be one of auto, float16, half, bfloat16, float32, float"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens must be >= 1, got -1"),
        (dict(no_such_arg=1), "unknown engine argument"),
        (dict(max_model_len=100000), "larger than the model's context length 4096"),
    ],
)
def test_bad_engine_arguments_name_the_field(tiny, kwargs, match) -> None:
    _, model_dir = tiny
    with pytest.raises(ValueError, match=match):
        LLM(str(model_dir), num_blocks=64, **kwargs)


def test_prompt_too_long_is_rejected_with_numbers(tiny) -> None:
    _, model_dir = tiny
    llm = LLM(str(model_dir), num_blocks=64, max_model_len=100)
    with pytest.raises(ValueError, match=r"prompt is 150 tokens, but max_model_len is 100"):
        llm.generate([[5] * 150], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_tokens 90 \+ prompt 20 tokens = 110 exceeds"):
        llm.generate([[5] * 20], SamplingParams(max_tokens=90), use_tqdm=False)
    # A bad prompt later in a batch leaves none of the batch queued, in any prompt form.
    for bad in ({"prompt_token_ids": [5] * 150}, {"text": "hi"}):
        with pytest.raises(ValueError, match=r"max_model_len is 100|needs 'prompt'"):
            llm.generate([[5] * 20, {"prompt_token_ids": [6] * 20}, bad], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    # The engine is still usable afterwards.
    assert len(llm.generate([[5] * 20], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_kv_pool_grows_on_demand_without_changing_outputs(tiny, monkeypatch) -> None:
    from mlxserve.engine import llm_engine as engine

    _, model_dir = tiny
    ps = prompts(12)
    reference = greedy_tokens(LLM(str(model_dir), num_blocks=256), ps)
    monkeypatch.setattr(engine, "INITIAL_KV_BLOCKS", 4)
    llm = LLM(str(model_dir), num_blocks=256)
    # The runner makes the arrays on the thread that steps, at the first step.
    assert llm.engine.runner.num_blocks == 0 and llm.engine.block_pool.num_allocated_blocks == 4
    assert greedy_tokens(llm, ps) == reference
    grown = llm.engine.runner.num_blocks
    assert 4 < grown <= 256 and grown == llm.engine.block_pool.num_allocated_blocks


def test_plain_script_without_main_guard(tiny, tmp_path) -> None:
    """No worker process is spawned, so a script (or notebook cell) needs no main guard."""
    import subprocess
    import sys

    _, model_dir = tiny
    script = tmp_path / "job.py"
    script.write_text(
        "from mlxserve import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, num_blocks=64)\n"
        "outs = llm.generate(['a b c', 'd e'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "print([len(o.outputs[0].token_ids) for o in outs])\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3, 3]"


@pytest.mark.parametrize(
    "kv_cache_dtype,hold_old_pool,async_scheduling",
    [("auto", False, True), ("auto", False, False), ("int8", False, True), ("auto", True, False)],
    ids=["float", "float-sync", "int8", "an-extra-reference-copies"],
)
def test_steps_update_the_kv_pool_in_place(
    tiny, caplog, kv_cache_dtype, hold_old_pool, async_scheduling
) -> None:
    """Each step's K/V write reuses the pool arrays' own buffers (MLX donates them to the
    scatter): the buffer addresses stay put from step to step, with steps scheduled ahead
    too. Holding the old pool arrays across a step (as a stray reference would) makes
    every step copy them instead: the addresses move, and the engine warns once (the
    watch compares steps collected with no later step in flight: synchronous ones)."""
    from mlxserve.worker.pool_watch import buffer_address

    _, model_dir = tiny
    llm = LLM(
        str(model_dir),
        num_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
        async_scheduling=async_scheduling,
    )
    engine, runner = llm.engine, llm.engine.runner
    runner.pool_watch.every = 1  # compare every step (the engine samples 2 in 8)
    held: list[mx.array] = []
    if hold_old_pool:
        launch = runner.launch

        def launch_holding(so, previous=None, start=True):
            held[:] = [] if runner.kv_cache is None else runner.kv_cache.arrays()
            return launch(so, previous, start)

        runner.launch = launch_holding
    caplog.set_level("WARNING", logger="mlxserve")
    engine.add_request("r", [5, 6, 7, 8, 9, 10], GREEDY)
    addresses = []  # per step: (shape, buffer address) of every pool array, never the arrays
    for _ in range(8):
        engine.step()
        if runner.kv_cache is not None:
            pools = runner.kv_cache.arrays()
            assert all(memoryview(a).c_contiguous for a in pools)  # what the scatter donates
            addresses.append([(a.shape, buffer_address(a)) for a in pools])
            del pools
    held.clear()
    assert len(addresses) == 8 and all(len(step) == 4 for step in addresses)  # 2 layers, K, V
    moved = [
        sum(before != after for before, after in zip(a, b, strict=True))
        for a, b in zip(addresses, addresses[1:], strict=False)
    ]
    copies = [r.getMessage() for r in caplog.records if "instead of updating" in r.getMessage()]
    if hold_old_pool:
        assert moved == [4] * 7
        assert len(copies) == 1 and "copied 4 of 4 KV pool arrays" in copies[0]
    else:
        assert moved == [0] * 7
        assert copies == [] and runner.pool_watch.num_copied_steps == 0
