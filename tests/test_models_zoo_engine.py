"""The zoo through the engine (LLM API): hybrid models on recurrent-state slots, sliding
windows that release their blocks, per-layer pools, against mlx-lm's greedy generation.

Each case is a tiny random mlx-lm checkpoint with a tokenizer, loaded by ``LLM(path)``
(float32, block size 4). As in tests/test_models_zoo.py, mlx-lm runs every prompt alone
with its own caches (``generate_step``); mlxserve's greedy tokens must be equal over 32
steps and the chosen tokens' log-probabilities close. Scenarios: alone, 8 mixed-length
prompts at once, chunked under a 16-token step budget, a prefix-cache hit, and with a pool
small enough to force preemptions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.models import mlx_lm_zoo
from tests import swa_llama
from tests.engine_helpers import VOCAB_SIZE, write_tokenizer
from tests.model_helpers import make_mlx_lm_checkpoint
from tests.zoo_configs import WINDOW, ZOO, config

NUM_STEPS = 32
BLOCK_SIZE = 4
PROMPT_LENS = (3, 9, 14, 21, 5, 30, 11, 17)
LOGPROB_TOL = 1e-4
NOISE_FACTOR = 4
PREFIX_BLOCKS = 7  # the prefix-hit prompt shares r5's first 28 tokens

HYBRID = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "granitemoehybrid", "nemotron_h"]
RECURRENT_ONLY = ["mamba", "mamba2"]  # no attention: no blocks, so nothing to preempt for
WINDOWED = ["gemma3_text", "gpt_oss", "swa_llama"]  # swa_llama: every layer windowed
CASES = HYBRID + RECURRENT_ONLY + WINDOWED + list(mlx_lm_zoo.PER_LAYER_POOLS)
CONFIGS = {name: ZOO.get(name) for name in CASES} | {
    "swa_llama": config("swa_llama", sliding_window=WINDOW)
}


@dataclass
class Case:
    oracle: object  # the mlx-lm model
    path: Path
    prompts: dict[str, list[int]]
    want: dict[str, tuple[list[int], np.ndarray]]  # prompt -> (tokens, chosen log-probs)
    noise: dict[str, float]


@pytest.fixture(scope="module")
def swa_llama_registered():
    """mlx-lm finds tests/swa_llama.py as mlx_lm.models.swa_llama; mlxserve runs it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "mlx_lm.models.swa_llama", swa_llama)
        patch.setitem(mlx_lm_zoo.MODEL_TYPES, "swa_llama", "sliding window in every layer")
        yield


def mlx_lm_generate(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """mlx-lm's greedy tokens and the log-probability of each."""
    from mlx_lm.generate import generate_step

    tokens, chosen = [], []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=NUM_STEPS, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    for token, logprobs in steps:
        tokens.append(int(token))
        chosen.append(float(logprobs[int(token)]))
    return tokens, np.array(chosen)


def mlx_lm_noise(model, prompt: list[int], tokens: list[int], chosen: np.ndarray) -> float:
    """How far mlx-lm's own log-probs move between one prefill and token-by-token decoding."""
    from mlx_lm.models.cache import make_prompt_cache

    seq = mx.array(prompt + tokens[:-1])[None]
    logits = model(seq, cache=make_prompt_cache(model))[0, len(prompt) - 1 :]
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return float(np.abs(logprobs[np.arange(len(tokens)), tokens] - chosen).max())


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory, swa_llama_registered):
    """name -> Case, built once per module."""
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            cfg = CONFIGS[name] | {"vocab_size": VOCAB_SIZE}
            if "vocab_size_per_layer_input" in cfg:
                cfg["vocab_size_per_layer_input"] = VOCAB_SIZE
            seed = sorted(CONFIGS).index(name)
            oracle, path = make_mlx_lm_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=seed)
            write_tokenizer(path)
            rng = np.random.default_rng(seed)
            prompts = {
                f"r{i}": rng.integers(3, VOCAB_SIZE, n).tolist() for i, n in enumerate(PROMPT_LENS)
            }
            prompts["prefix_hit"] = (
                prompts["r5"][: PREFIX_BLOCKS * BLOCK_SIZE]
                + rng.integers(3, VOCAB_SIZE, 6).tolist()
            )
            want = {rid: mlx_lm_generate(oracle, p) for rid, p in prompts.items()}
            noise = {rid: mlx_lm_noise(oracle, prompts[rid], *want[rid]) for rid in prompts}
            cache[name] = Case(oracle, path, prompts, want, noise)
        return cache[name]

    return get


def make_llm(c: Case, **kwargs) -> LLM:
    args = {"block_size": BLOCK_SIZE, "num_blocks": 160, "max_num_seqs": 8} | kwargs
    return LLM(str(c.path), **args)


PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=0)


def generate(llm: LLM, c: Case, rids: list[str]) -> dict[str, object]:
    outs = llm.generate([c.prompts[rid] for rid in rids], PARAMS, use_tqdm=False)
    return dict(zip(rids, outs, strict=True))


def assert_matches(c: Case, rid: str, out, what: str) -> None:
    """Tokens equal mlx-lm's, chosen log-probs within float noise."""
    sample = out.outputs[0]
    want_tokens, want_logprobs = c.want[rid]
    assert sample.token_ids == want_tokens, f"{what} {rid}"
    got = np.array([entry[t] for t, entry in zip(sample.token_ids, sample.logprobs, strict=True)])
    tol = max(LOGPROB_TOL, NOISE_FACTOR * c.noise[rid])
    np.testing.assert_allclose(got, want_logprobs, atol=tol, rtol=LOGPROB_TOL, err_msg=what)


BATCH = [f"r{i}" for i in range(len(PROMPT_LENS))]


@pytest.mark.parametrize("name", CASES)
def test_alone(name: str, case) -> None:
    c = case(name)
    assert_matches(c, "r5", generate(make_llm(c), c, ["r5"])["r5"], "alone")


@pytest.mark.parametrize("name", CASES)
def test_batch_of_8_mixed_lengths(name: str, case) -> None:
    c = case(name)
    outs = generate(make_llm(c), c, BATCH)
    for rid in BATCH:
        assert_matches(c, rid, outs[rid], "batch")


@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_16_token_budget(name: str, case) -> None:
    c = case(name)
    llm = make_llm(c, max_num_batched_tokens=16)
    outs = generate(llm, c, BATCH)
    for rid in BATCH:
        assert_matches(c, rid, outs[rid], "budget 16")


@pytest.mark.parametrize("name", CASES)
def test_prefix_cache_hit(name: str, case) -> None:
    """The second request reuses the first's 7 blocks (and, for a hybrid model, the state
    snapshot at the end of its prompt's last full block): only 6 tokens are computed."""
    c = case(name)
    llm = make_llm(c)
    assert_matches(c, "r5", generate(llm, c, ["r5"])["r5"], "cached request")
    before = llm.engine.num_prompt_tokens_computed
    out = generate(llm, c, ["prefix_hit"])["prefix_hit"]
    assert out.num_cached_tokens == PREFIX_BLOCKS * BLOCK_SIZE
    assert llm.engine.num_prompt_tokens_computed - before == 6
    assert_matches(c, "prefix_hit", out, "prefix hit")


@pytest.mark.parametrize("caching", [False, True], ids=["recompute", "prefix_cache"])
@pytest.mark.parametrize("name", sorted(set(CASES) - set(RECURRENT_ONLY)))
def test_recompute_after_preemption(name: str, caching: bool, case) -> None:
    """A pool of 40 blocks (10 when every layer is windowed) cannot hold the 8 requests at
    once: some are preempted and recomputed (their states too), with the same tokens. With
    prefix caching a preempted request resumes from its own cached blocks (and state
    snapshots) where they survived."""
    c = case(name)
    num_blocks = 10 if name == "swa_llama" else 40
    llm = make_llm(
        c, num_blocks=num_blocks, max_num_batched_tokens=16, enable_prefix_caching=caching
    )
    outs = generate(llm, c, BATCH)
    assert llm.engine.get_stats().num_preemptions > 0
    for rid in BATCH:
        assert_matches(c, rid, outs[rid], "preempted")


@pytest.mark.parametrize("name", ["qwen3_5", "granitemoehybrid"])
def test_hybrid_1000_token_shared_prefix(name: str, tmp_path: Path) -> None:
    """A 1000-token prompt, then one that extends it by 24 tokens: the second computes only
    its 24 new tokens (from the state snapshot at the first prompt's end), and one sharing
    its first 700 tokens resumes at the last state snapshot before them (one every
    snapshot_interval tokens). Tokens equal mlx-lm's and the outputs without caching."""
    cfg = CONFIGS[name] | {"vocab_size": VOCAB_SIZE, "max_position_embeddings": 2048}
    oracle, path = make_mlx_lm_checkpoint(tmp_path, cfg, seed=3)
    write_tokenizer(path)
    c = Case(oracle, path, {}, {}, {})
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, VOCAB_SIZE, 1000).tolist()
    prompts = {
        "first": prefix,
        "extends": prefix + rng.integers(3, VOCAB_SIZE, 24).tolist(),
        "shares_700": prefix[:700] + rng.integers(3, VOCAB_SIZE, 20).tolist(),
    }
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(c, num_blocks=800, max_num_batched_tokens=256)
    interval = llm.engine.scheduler.kv_cache_manager.snapshot_interval
    assert 0 < interval < 700 and interval % BLOCK_SIZE == 0
    uncached = make_llm(c, num_blocks=800, max_num_batched_tokens=256, enable_prefix_caching=False)
    engine = llm.engine
    for rid, resumes_at in [
        ("first", 0),
        ("extends", 1000),
        ("shares_700", 700 // interval * interval),
    ]:
        before = engine.num_prompt_tokens_computed
        (out,) = llm.generate([prompts[rid]], params, use_tqdm=False)
        assert out.num_cached_tokens == resumes_at, rid
        assert engine.num_prompt_tokens_computed - before == len(prompts[rid]) - resumes_at
        (plain,) = uncached.generate([prompts[rid]], params, use_tqdm=False)
        want = mlx_lm_generate(c.oracle, prompts[rid])[0][:8]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids == want, rid


def address(array: mx.array) -> int:
    """Where an evaluated array's data lives (the view is dropped at once)."""
    return np.asarray(memoryview(array)).__array_interface__["data"][0]


@pytest.mark.parametrize("name", HYBRID + RECURRENT_ONLY)
def test_state_pools_are_written_in_place(name: str, case) -> None:
    """Steps write the recurrent-state pools in place: each pool array keeps its memory.

    A copy would have to coexist with the old pool, so an unchanged address means no step
    copied it. (Before, a state read still pending when the step's write ran kept MLX from
    updating the pool in place: every step copied every slot of every state array, so a
    single stream slowed with max_num_seqs.)
    """
    c = case(name)
    llm = make_llm(c)
    generate(llm, c, ["r0"])  # the first step makes the pool
    engine = llm.engine

    def addresses() -> list[list[int]]:
        return [[address(a) for a in arrays] for arrays in engine.runner.kv_cache.states]

    before = addresses()
    for rid in BATCH:
        engine.add_request(rid, None, PARAMS, prompt_token_ids=c.prompts[rid])
    outs, steps = {}, 0
    while engine.has_unfinished_requests():  # prefills, batched decodes, snapshots
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
        # Checked every step: a copy each step could land back on the old memory every
        # other step (the allocator reuses the freed pool).
        assert addresses() == before, f"step {steps}"
    for rid in BATCH:
        assert_matches(c, rid, outs[rid], "in place")


# ---- sliding windows release their blocks ------------------------------------------------------
def held_blocks(llm: LLM, rid: str) -> list[int]:
    """Per KV cache group: the blocks request ``rid`` holds (released ones excluded)."""
    kv = llm.engine.scheduler.kv_cache_manager
    return [sum(1 for b in m.req_to_blocks.get(rid, ()) if not b.is_null) for m in kv.managers]


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_windowed_groups_hold_only_their_window(name: str, case) -> None:
    """A 60-token prompt and 32 decodes: after every step the windowed group holds the
    blocks of its window (and the step's and the last step's chunks) only, the
    full-attention group every block; the tokens are mlx-lm's."""
    c = case(name)
    prompt = np.random.default_rng(7).integers(3, VOCAB_SIZE, 60).tolist()
    want, _ = mlx_lm_generate(c.oracle, prompt)
    llm = make_llm(c, max_num_batched_tokens=16)
    engine = llm.engine
    windows = [g.window for g in engine.runner.layout.groups]
    assert sorted(windows, key=str) == [8, None]
    engine.add_request("a", None, PARAMS, prompt_token_ids=prompt)
    out, peak = None, [0, 0]
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        held = held_blocks(llm, "a")
        request = engine.scheduler.requests.get("a")
        if request is None:
            continue
        for g, window in enumerate(windows):
            if window is None:
                assert held[g] == -(-request.num_computed_tokens // BLOCK_SIZE)
            else:
                peak[g] = max(peak[g], held[g])
                # The window behind the chunk, plus the chunk and, while the pool has
                # room, the last step's (16 tokens at most each): blocks leave the
                # window once registered in the prefix cache.
                assert held[g] <= -(-(window - 1 + 2 * 16) // BLOCK_SIZE) + 1
                if request.num_output_tokens > 1:  # decoding: the window and one token
                    assert held[g] <= -(-(window - 1 + 1) // BLOCK_SIZE) + 1
    assert out.outputs[0].token_ids == want
    assert engine.block_pool.get_usage() == 0.0  # all freed at the end


@pytest.mark.parametrize("name", ["gemma3_text", "swa_llama"])
def test_a_prompt_past_the_window_in_one_step_is_a_prefix_hit_later(name: str, case) -> None:
    """A 60-token prompt computed in one step (window 8): its blocks leave the window
    before the step's output is processed (async scheduling). A later prompt sharing its
    first 40 tokens still hits all 40, as with full attention, with mlx-lm's tokens."""
    c = case(name)
    rng = np.random.default_rng(9)
    first = rng.integers(3, VOCAB_SIZE, 60).tolist()
    second = first[:40] + rng.integers(3, VOCAB_SIZE, 10).tolist()
    llm = make_llm(c, max_num_batched_tokens=64)
    llm.generate([first], PARAMS, use_tqdm=False)
    (out,) = llm.generate([second], PARAMS, use_tqdm=False)
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == mlx_lm_generate(c.oracle, second)[0]


def test_all_windowed_sequence_longer_than_the_pool(case) -> None:
    """Every layer windowed (Mistral-style): a 92-token sequence runs in a pool of 7
    usable blocks (28 tokens), because the blocks behind the window are released."""
    c = case("swa_llama")
    prompt = np.random.default_rng(8).integers(3, VOCAB_SIZE, 60).tolist()
    want, _ = mlx_lm_generate(c.oracle, prompt)
    llm = make_llm(c, num_blocks=8, max_num_batched_tokens=16)
    assert llm.engine.scheduler.num_pool_tokens is None  # no length limit from the pool
    (out,) = llm.generate([prompt], PARAMS, use_tqdm=False)
    assert out.outputs[0].token_ids == want
    assert llm.engine.get_stats().num_preemptions == 0


@pytest.mark.parametrize("name", ["qwen3_5"])
def test_int8_kv_cache_quantizes_attention_layers_only(name: str, case) -> None:
    """kv_cache_dtype int8 on a hybrid model: the attention pools are 8-bit, the recurrent
    state pools keep the dtypes and shapes of the float engine's, and the greedy tokens
    stay mlx-lm's (float cache) with log-probs within the 8-bit cache's error."""
    c = case(name)
    float_llm, int8_llm = make_llm(c), make_llm(c, kv_cache_dtype="int8")
    outs = {k: generate(llm, c, ["r5"])["r5"] for k, llm in (("f", float_llm), ("q", int8_llm))}
    pools = {k: llm.engine.runner.kv_cache for k, llm in (("f", float_llm), ("q", int8_llm))}
    assert pools["q"].keys and all(p.dtype == mx.int8 for p in pools["q"].keys + pools["q"].values)
    assert [[(a.dtype, a.shape) for a in s] for s in pools["q"].states] == [
        [(a.dtype, a.shape) for a in s] for s in pools["f"].states
    ]
    assert_matches(c, "r5", outs["f"], "float cache")
    sample = outs["q"].outputs[0]
    assert sample.token_ids == c.want["r5"][0]
    got = [entry[t] for t, entry in zip(sample.token_ids, sample.logprobs, strict=True)]
    assert np.abs(np.array(got) - c.want["r5"][1]).max() < 0.05
