"""Draft-model speculative decoding end to end on tiny random models.

The target is the tiny model of test_spec_decode_engine; drafts come from a copy of it
with noisy weights (same tokenizer, agrees with the target about a third of the time, so
both accepted and rejected drafts occur) or from the target itself (every greedy draft is
then the target's own choice: any slip in the drafter's positions or catch-up shows as a
rejection). Oracles: the engine without speculation (checked against mlx-lm's greedy loop
in test_spec_decode_engine), and for sampling the target's softmax computed by mlx-lm.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.exceptions import ParameterError
from tests.chi_square import assert_second_tokens_fit
from tests.engine_helpers import (
    VOCAB_SIZE,
    make_tiny_model_dir,
    perturb_weights,
    write_tokenizer,
)
from tests.test_spec_decode_engine import GREEDY, greedy, prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """(mlx-lm oracle, target dir, noisy draft dir)."""
    root = tmp_path_factory.mktemp("draft")
    oracle, target = make_tiny_model_dir(root / "target", seed=3)
    return oracle, target, perturb_weights(target, root / "noisy", 0.1)


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    _, target, _ = models
    return greedy(LLM(str(target), num_blocks=512), prompts())


def draft_llm(target, draft, k: int = 3, **kwargs) -> LLM:
    spec = {"model": str(draft), "num_speculative_tokens": k, "disable_by_batch_size": 64}
    spec["disable_by_cost"] = False  # wall-clock decisions would move the counts asserted
    return LLM(str(target), speculative_config=spec, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=512),
        dict(num_blocks=512, max_num_batched_tokens=16),  # chunked prefill, catch-up in parts
        dict(num_blocks=18, block_size=8, max_model_len=128),  # preemption forced
    ],
    ids=["batched", "budget16", "preemption"],
)
def test_greedy_with_a_draft_model_equals_without_speculation(models, reference, kwargs) -> None:
    _, target, noisy = models
    llm = draft_llm(target, noisy, **kwargs)
    assert greedy(llm, prompts()) == reference
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if kwargs["num_blocks"] < 512:
        assert stats.num_preemptions > 0


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(models, reference) -> None:
    """Alone, then with prefix hits (the drafter recomputes what it did not write), in
    steps of 5 drafts: the drafter's KV must hold exactly the target's tokens."""
    _, target, _ = models
    llm = draft_llm(target, target, k=5, num_blocks=512)
    ps = prompts()
    for i in (0, 1, 3, 6):  # 0, 3, 6 share a 40-token prefix: the later ones hit the cache
        assert greedy(llm, [ps[i]]) == [reference[i]]
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_draft_tokens > 40
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_the_target_as_its_own_draft_in_a_batch_has_every_draft_accepted(models, reference) -> None:
    """Batched, the requests' catch-ups differ in length (1 token, or 2 after a full
    accept) and the drafter orders them differently from the target: each request must
    still get its own drafts."""
    _, target, _ = models
    # A small budget staggers the prompts: requests reach decoding in different steps.
    llm = draft_llm(target, target, k=4, num_blocks=512, max_num_batched_tokens=24)
    assert greedy(llm, prompts()) == reference
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 100
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_speculating_and_plain_requests_share_steps(models) -> None:
    """Requests that do not speculate (penalties) and ones that do, in one batch."""
    _, target, noisy = models
    base = LLM(str(target), num_blocks=512)
    llm = draft_llm(target, noisy, num_blocks=512)
    ps = prompts(6)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    ] * 3
    want = base.generate(ps, params, use_tqdm=False)
    got = llm.generate(ps, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logprobs_of_accepted_tokens_equal_those_without_speculation(models, method) -> None:
    _, target, noisy = models
    base = LLM(str(target), num_blocks=512)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        spec = {"model": str(noisy), "num_speculative_tokens": 3}
    llm = LLM(str(target), num_blocks=512, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    ps = prompts(4)
    want = base.generate(ps, params, use_tqdm=False)
    got = llm.generate(ps, params, use_tqdm=False)
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs) == 20
        for we, ge in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert we.keys() == ge.keys()
            assert [ge[t] for t in we] == pytest.approx([we[t] for t in we], abs=1e-4)
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            w.outputs[0].cumulative_logprob, abs=1e-3
        )


def test_sampled_tokens_keep_the_target_distribution(models, tmp_path) -> None:
    """Chi-square: the 2nd token of many sampled requests, drafted by the noisy model
    (q = its softmax at the same temperature) and verified, against the target's
    distribution from mlx-lm: P(t2) = sum over t1 of P(t1) P(t2 | t1)."""
    oracle, target, _ = models
    temperature, num_samples = 0.5, 1200
    prompt = [278] + [344] * 10

    # A noisier draft than the others': q far enough from p for many rejections.
    noisier = perturb_weights(target, tmp_path / "noisier", 0.4)
    spec = {"model": str(noisier), "num_speculative_tokens": 1, "disable_by_batch_size": 256}
    spec["disable_by_cost"] = False  # every 2nd token drafted: no wall-clock decisions
    llm = LLM(str(target), max_num_seqs=256, seed=0, speculative_config=spec)
    stats = assert_second_tokens_fit(llm, oracle, prompt, temperature, num_samples)
    assert stats.spec_decode_num_accepted_tokens > num_samples // 5  # and accepted many


def test_a_draft_model_with_another_tokenizer_is_refused(models, tmp_path) -> None:
    _, target, noisy = models
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other / name).write_bytes((noisy / name).read_bytes())
    write_tokenizer(other, vocab_size=300)  # other merges: other ids for the same text
    with pytest.raises(ParameterError) as e:
        draft_llm(target, other, num_blocks=64)
    assert e.value.parameter == "speculative_config.model"
    message = str(e.value)
    assert "tokenizer" in message and "vocabulary size 300" in message and str(other) in message


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model"),
        ({"model": ""}, "speculative_config.model"),
    ],
)
def test_bad_draft_model_config_names_the_field(config, field) -> None:
    from mlxserve.config import EngineConfig

    with pytest.raises(ParameterError) as e:
        EngineConfig(speculative_config=config)
    assert e.value.parameter == field


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_the_method_follows_from_the_model_and_parallel_ranks_are_refused(parallel) -> None:
    from mlxserve.config import EngineConfig

    config = EngineConfig(speculative_config={"model": "some/draft"})
    assert config.speculative_config.method == "draft_model"
    with pytest.raises(ParameterError) as e:
        EngineConfig(speculative_config={"model": "some/draft"}, **{parallel: 2})
    assert e.value.parameter == parallel and "draft model" in str(e.value)


def test_a_draft_with_a_padded_embedding_drafts_in_the_targets_vocabulary(
    models, reference, tmp_path
) -> None:
    """The target itself with 64 more embedding and head rows (as model families pad
    differently), rows that score 5x the real ones: only if its logits are cut to the
    target's width are its greedy drafts the target's own tokens, every one accepted."""
    import json
    import shutil

    _, target, _ = models
    padded = tmp_path / "padded"
    padded.mkdir()
    weights = mx.load(str(target / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = mx.concatenate([weights[name], 5 * weights[name][:64]])
    mx.save_safetensors(str(padded / "model.safetensors"), weights)
    config = json.loads((target / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps(config | {"vocab_size": VOCAB_SIZE + 64}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, padded / name)
    llm = draft_llm(target, padded, num_blocks=512)
    assert greedy(llm, prompts(4)) == reference[:4]
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 20
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_memory_planning_counts_the_draft_models_kv(models) -> None:
    """In a fixed KV budget a block costs both models' K/V: with the target drafting for
    itself (the same K/V per block) the pool holds half the blocks."""
    _, target, _ = models
    budget = {"kv_cache_memory_bytes": 2 << 20, "max_model_len": 256}  # under the cap
    alone = LLM(str(target), **budget).engine.plan
    both = draft_llm(target, target, **budget).engine.plan
    assert both.bytes_per_block == 2 * alone.bytes_per_block
    assert both.num_blocks - 1 == (alone.num_blocks - 1) // 2


def test_an_int8_kv_cache_quantizes_the_draft_models_pool_too(models) -> None:
    """--kv-cache-dtype int8: the draft's pool holds 8-bit rows as the target's does (the
    plan counts them so); greedy output equals int8 without speculation."""
    _, target, _ = models
    base = LLM(str(target), num_blocks=512, kv_cache_dtype="int8")
    llm = draft_llm(target, target, k=4, num_blocks=512, kv_cache_dtype="int8")
    ps = prompts(4)
    assert greedy(llm, ps) == greedy(base, ps)
    runner = llm.engine.runner
    assert runner.drafter.kv_cache.keys[0].dtype == runner.kv_cache.keys[0].dtype == mx.int8
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 20
