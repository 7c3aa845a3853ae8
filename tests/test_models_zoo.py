"""The model zoo: mlx-lm architectures run by mlxserve's adapter, token for token against
mlx-lm's own greedy generation (``mlx_lm.generate.generate_step``) on the same weights.

Each case (tests/zoo_configs.py) is a seeded tiny random mlx-lm model saved as a checkpoint
and built by ``mlx_lm_zoo.build`` from its config.json + safetensors. mlxserve runs it through
a block pool (tests/model_helpers.BlockPoolRunner: shuffled block tables, block size 4) in
float32: alone, as a batch of 8 mixed-length prompts joining at different steps, under a
16-token step budget (chunked prefills sharing steps with decodes), after a prefix-cache hit,
and across recompute preemptions (all of these for the CORE families; see BREADTH for the
rest). mlx-lm runs every prompt alone with its own caches. Over
32 greedy steps the tokens must be equal and the log-probabilities close: within 1e-4, or
within 4x mlx-lm's own float noise on that request (its prefill and its decode disagree by
that much; e.g. up to 6e-4 for the tiny dbrx under OpenBLAS). Sliding-window cases use a
window of 8 tokens, shorter than most prompts. Hybrid cases (recurrent state) need the
engine's state slots: tests/test_models_zoo_engine.py runs them (and the windowed and
per-layer-pool families) through the LLM API.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxserve.loader.local import read_model_dir
from mlxserve.models import MODEL_MODULES, build_model, load_weights_strict, mlx_lm_zoo
from mlxserve.models.mlx_lm_adapter import MlxLmModel
from tests.model_helpers import (
    BlockPoolRunner,
    greedy_generate,
    greedy_generate_budgeted,
    make_mlx_lm_checkpoint,
)
from tests.zoo_configs import WINDOW, ZOO

NUM_STEPS = 32
BLOCK_SIZE = 4
PROMPT_LENS = (3, 9, 14, 21, 5, 30, 11, 17)
LOGPROB_TOL = 1e-4  # float32, atol and rtol
NOISE_FACTOR = 4  # ... or this many times mlx-lm's own prefill-vs-decode difference
PREFIX_BLOCKS = 7  # the prefix-hit request reuses 7 blocks (28 tokens) of a 30-token prompt

# Every scenario for the families issue 12 names (and their variants); the rest of the zoo
# (breadth) runs alone, chunked under the budget (4 prompts) and preempted, to keep the
# file quick: mlx-lm's own generation is the slow part (~3 ms a token for these models).
CORE = [
    "cohere2",
    "deepseek_v2",
    "ernie4_5",
    "exaone",
    "gemma3_text",
    "gemma4_text",
    "gemma4_text-moe-k_eq_v",
    "glm4",
    "gpt_oss",
    "granite",
    "internlm2",
    "internlm3",
    "llama",
    "llama-sliding",
    "minicpm",
    "mistral",
    "mixtral",
    "olmo2",
    "phi3",
    "phi3-longrope",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "stablelm",
    "starcoder2",
]
# Recurrent layers need the engine's state slots (tests/test_models_zoo_engine.py).
HYBRID = [
    "granitemoehybrid",
    "lfm2",
    "mamba",
    "mamba2",
    "nemotron_h",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
]
BREADTH = sorted(set(ZOO) - set(CORE) - set(HYBRID))
POOLED = sorted(set(ZOO) - set(HYBRID))  # every case the block-pool runner can run
BREADTH_PROMPTS = ("r1", "r3", "r5", "r6")


@dataclass
class Zoo:
    """One architecture: the mlx-lm oracle, mlxserve's model, prompts and mlx-lm's outputs."""

    oracle: nn.Module
    model: MlxLmModel
    prompts: dict[str, list[int]]
    want: dict[str, tuple[list[int], np.ndarray]]  # prompt -> (tokens, logprobs)
    noise: dict[str, float]  # prompt -> mlx-lm's own prefill-vs-decode log-prob difference


def mlx_lm_generate(model: nn.Module, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """mlx-lm's own greedy generation: tokens and the log-probabilities each came from."""
    from mlx_lm.generate import generate_step

    tokens, rows = [], []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=NUM_STEPS, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    for token, logprobs in steps:
        tokens.append(int(token))
        rows.append(np.array(logprobs))
    return tokens, np.stack(rows)


def build_zoo(name: str, path: Path) -> Zoo:
    """The case's model and oracle; mlx-lm's generations for the prompts its tests use."""
    # Seeds by position among the cases the block-pool runner runs (then the hybrids).
    seed = POOLED.index(name) if name in POOLED else len(POOLED) + HYBRID.index(name)
    oracle, path = make_mlx_lm_checkpoint(path, ZOO[name], seed=seed)
    config, weights = read_model_dir(path)
    if config["model_type"] in MODEL_MODULES:  # hand-written: the registry would pick those
        model = mlx_lm_zoo.build(config, weights, load_weights=load_weights_strict)
    else:  # the registry's fallback to the adapter
        model = build_model(config, weights)
    assert isinstance(model, MlxLmModel)
    rng = np.random.default_rng(seed)
    prompts = {
        f"r{i}": rng.integers(0, model.vocab_size, n).tolist() for i, n in enumerate(PROMPT_LENS)
    }
    # Shares the 30-token prompt's first 28 tokens (7 blocks), then goes its own way.
    prompts["prefix_hit"] = (
        prompts["r5"][: PREFIX_BLOCKS * BLOCK_SIZE] + rng.integers(0, model.vocab_size, 6).tolist()
    )
    if name not in CORE:
        prompts = {rid: prompts[rid] for rid in BREADTH_PROMPTS}
    want = {rid: mlx_lm_generate(oracle, prompt) for rid, prompt in prompts.items()}
    noise = {rid: mlx_lm_noise(oracle, prompts[rid], *want[rid]) for rid in prompts}
    return Zoo(oracle, model, prompts, want, noise)


def mlx_lm_noise(
    model: nn.Module, prompt: list[int], tokens: list[int], logprobs: np.ndarray
) -> float:
    """How far mlx-lm's log-probs move when it prefills prompt + tokens in one forward pass
    instead of decoding them one by one: the float noise of this model and request."""
    from mlx_lm.models.cache import make_prompt_cache

    seq = mx.array(prompt + tokens[:-1])[None]
    logits = np.array(model(seq, cache=make_prompt_cache(model))[0])  # (len, vocab)
    return float(np.abs(log_softmax(logits[len(prompt) - 1 :]) - logprobs).max())


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    """name -> Zoo, built once per module."""
    cache: dict[str, Zoo] = {}

    def get(name: str) -> Zoo:
        if name not in cache:
            cache[name] = build_zoo(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))


def assert_matches(z: Zoo, rid: str, tokens: list[int], logits: np.ndarray, what: str) -> None:
    """Tokens equal mlx-lm's; on a divergence, say how close mlx-lm's top two were there."""
    want_tokens, want_logprobs = z.want[rid]
    got_logprobs = log_softmax(logits)
    if tokens != want_tokens:
        k = next(i for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True)) if a != b)
        top2 = np.sort(want_logprobs[k])[-2:]
        pytest.fail(
            f"{what} {rid}: token {k} is {tokens[k]}, mlx-lm's is {want_tokens[k]}; mlx-lm's "
            f"top-2 gap there {top2[1] - top2[0]:.2e}, largest log-prob difference "
            f"{np.abs(got_logprobs[k] - want_logprobs[k]).max():.2e}"
        )
    tol = max(LOGPROB_TOL, NOISE_FACTOR * z.noise[rid])
    np.testing.assert_allclose(
        got_logprobs, want_logprobs, atol=tol, rtol=LOGPROB_TOL, err_msg=f"{what} {rid}"
    )


def runner(z: Zoo, seed: int = 0) -> BlockPoolRunner:
    return BlockPoolRunner(z.model, num_blocks=160, block_size=BLOCK_SIZE, seed=seed)


@pytest.mark.parametrize("name", POOLED)
def test_alone(name: str, zoo) -> None:
    z = zoo(name)
    got, logits = greedy_generate(runner(z), {"r5": z.prompts["r5"]}, NUM_STEPS)
    assert_matches(z, "r5", got["r5"], logits["r5"], "alone")


@pytest.mark.parametrize("name", CORE)
def test_batch_of_8_mixed_lengths(name: str, zoo) -> None:
    """Eight prompts of 3..30 tokens; some join later, so prefills share steps with decodes."""
    z = zoo(name)
    prompts = {rid: p for rid, p in z.prompts.items() if rid != "prefix_hit"}
    join_at = {"r2": 1, "r4": 3, "r7": 6}
    got, logits = greedy_generate(runner(z, seed=1), prompts, NUM_STEPS, join_at=join_at)
    for rid in prompts:
        assert_matches(z, rid, got[rid], logits[rid], "batch")


@pytest.mark.parametrize("name", POOLED)
def test_chunked_prefill_16_token_budget(name: str, zoo) -> None:
    """The 8 prompts (4 for breadth cases) under a 16-token step budget: the longer ones are
    prefilled in chunks that share steps with the others' decodes."""
    z = zoo(name)
    prompts = {rid: p for rid, p in z.prompts.items() if rid != "prefix_hit"}
    got, logits = greedy_generate_budgeted(runner(z, seed=2), prompts, NUM_STEPS, budget=16)
    for rid in prompts:
        assert_matches(z, rid, got[rid], logits[rid], "budget 16")


@pytest.mark.parametrize("name", CORE)
def test_prefix_cache_hit(name: str, zoo) -> None:
    """A request whose first 7 blocks are another request's computes only its 6 new tokens."""
    z = zoo(name)
    run = runner(z, seed=3)
    run.step([("r5", z.prompts["r5"])])  # the cached request's prompt, into the pool
    run.fork_prefix("r5", "prefix_hit", PREFIX_BLOCKS * BLOCK_SIZE)
    suffix = z.prompts["prefix_hit"][PREFIX_BLOCKS * BLOCK_SIZE :]
    tokens, rows = [], []
    feed = suffix
    for _ in range(NUM_STEPS):
        logits = run.step([("prefix_hit", feed)])["prefix_hit"]
        rows.append(logits)
        feed = [int(np.argmax(logits))]
        tokens.extend(feed)
    assert run.num_computed["prefix_hit"] == len(z.prompts["prefix_hit"]) + NUM_STEPS - 1
    assert_matches(z, "prefix_hit", tokens, np.stack(rows), "prefix hit")


@pytest.mark.parametrize("name", POOLED)
def test_recompute_after_preemption(name: str, zoo) -> None:
    """One request preempted in the middle of its prefill, one while decoding."""
    z = zoo(name)
    prompts = {rid: z.prompts[rid] for rid in ("r1", "r3", "r5")}
    preempt_at = {"r5": 1, "r3": 9}  # r5's 30 tokens take two 16-token steps
    got, logits = greedy_generate_budgeted(
        runner(z, seed=4), prompts, NUM_STEPS, budget=16, preempt_at=preempt_at
    )
    for rid in prompts:
        assert_matches(z, rid, got[rid], logits[rid], "preempted")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_pool_shapes_as_listed(name: str, zoo) -> None:
    """Exactly the PER_LAYER_POOLS models need K/V pools that differ per layer (or K from
    V); the others' tensors all have one shape."""
    layout = zoo(name).model.kv_cache_layout
    shapes = set(layout.tensor_shapes)
    uniform = len(shapes) <= 1 and all(k == v for _, k, v in shapes)  # 0: no attention
    assert uniform == (name.split("-")[0] not in mlx_lm_zoo.PER_LAYER_POOLS)


def test_sliding_window_cases_exercise_their_window(zoo, monkeypatch) -> None:
    """The windowed cases would fail if the window were ignored: with the attention op
    dropping it, the same model is far from mlx-lm (checked on two families)."""
    from mlxserve import ops

    attend = ops.paged_attention

    def without_window(q, k_cache, v_cache, md, scale, window=None, sinks=None):
        return attend(q, k_cache, v_cache, md, scale, None, sinks)

    for name in ("gemma3_text", "gpt_oss"):
        z = zoo(name)
        kinds = {spec.kind: spec.window for spec in z.model.cache_specs}
        assert kinds == {"full_attention": None, "sliding_window": WINDOW}
        want = z.want["r5"][1][0]  # mlx-lm's log-probs after the 30-token prompt
        with monkeypatch.context() as patch:
            patch.setattr(ops, "paged_attention", without_window)
            run = BlockPoolRunner(z.model, num_blocks=32, block_size=BLOCK_SIZE)
            got = log_softmax(run.step([("r5", z.prompts["r5"])])["r5"])
        assert np.abs(got - want).max() > 1e-2, name
        run = BlockPoolRunner(z.model, num_blocks=32, block_size=BLOCK_SIZE)
        got = log_softmax(run.step([("r5", z.prompts["r5"])])["r5"])
        assert np.abs(got - want).max() < 1e-3, name  # and with it, mlx-lm's
