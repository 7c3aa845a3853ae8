"""N-gram speculative decoding end to end on a tiny random model.

Oracles: the same engine without speculation (itself checked against mlx-lm's greedy loop
in tests/test_engine.py, and here again on a few prompts), and for sampling the tiny
model's own softmax computed by mlx-lm.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.core.spec_cost import MIN_STEPS, PROBE_INTERVAL, PROBE_STEPS
from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import StructuredOutputsParams
from tests.chi_square import assert_fits
from tests.engine_helpers import VOCAB_SIZE, make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# No cost back-off (it decides from wall-clock step times): the draft counts asserted
# below are then the same in every run; test_cost_backoff_* turns it on with a fake clock.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "disable_by_batch_size": 64,
    "disable_by_cost": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy outputs of prompts() without speculation."""
    _, model_dir = tiny
    llm = LLM(str(model_dir), num_blocks=512)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def prompts(n: int = 12) -> list[list[int]]:
    """Mixed lengths (8..90 tokens), each repeating one of its spans (as a quote or a code
    edit does), a third of them sharing a 40-token prefix."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 300, size=40).tolist()
    out = []
    for i in range(n):
        head = rng.integers(3, 300, size=int(rng.integers(4, 40))).tolist()
        if i % 3 == 0:
            head = shared + head
        out.append(head + head[: int(rng.integers(2, 12))])
    return out


def spec_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), speculative_config=SPEC, **kwargs)


def greedy(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def num_accepted(llm: LLM) -> int:
    return llm.engine.get_stats().spec_decode_num_accepted_tokens


def test_reference_matches_mlx_lm(tiny, reference) -> None:
    oracle, _ = tiny
    ps = prompts()
    for i in (0, 4, 7):
        assert reference[i] == mlx_lm_greedy(oracle, ps[i], 24)[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=512),
        dict(num_blocks=512, max_num_batched_tokens=16),  # chunked prefill, small budget
        dict(num_blocks=512, enable_prefix_caching=False),
        dict(num_blocks=512, block_size=4),
    ],
    ids=["batched", "budget16", "no-prefix-cache", "block4"],
)
def test_greedy_batched_equals_without_speculation(tiny, reference, kwargs) -> None:
    _, model_dir = tiny
    llm = spec_llm(model_dir, **kwargs)
    assert greedy(llm, prompts()) == reference
    assert num_accepted(llm) > 0


def test_greedy_alone_and_with_prefix_hits_equals_without_speculation(tiny, reference) -> None:
    _, model_dir = tiny
    llm = spec_llm(model_dir, num_blocks=512)
    ps = prompts()
    for i in (0, 1, 3, 6):  # 0, 3, 6 share a prefix: the later ones hit the cache
        assert greedy(llm, [ps[i]]) == [reference[i]]
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_greedy_with_preemption_equals_without_speculation(tiny, reference) -> None:
    _, model_dir = tiny
    llm = spec_llm(model_dir, num_blocks=18, block_size=8, max_model_len=128)
    assert greedy(llm, prompts()) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_stops_and_limits_match_without_speculation(tiny, reference) -> None:
    _, model_dir = tiny
    base = LLM(str(model_dir), num_blocks=512)
    llm = spec_llm(model_dir, num_blocks=512)
    ps = prompts()
    tok = base.get_tokenizer()
    text = tok.decode(reference[1])
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        # A stop string from the middle of the output, maybe among accepted drafts.
        SamplingParams(temperature=0.0, max_tokens=24, stop=[text[len(text) // 2 :][:3]]),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[reference[2][5]]),
        SamplingParams(
            temperature=0.0, max_tokens=24, stop_token_ids=[reference[3][2]], min_tokens=9
        ),
    ]
    idx = [0, 1, 2, 3]
    batch = [ps[i] for i in idx]
    want = base.generate(batch, params, use_tqdm=False)
    got = llm.generate(batch, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
    assert [len(w.outputs[0].token_ids) < 24 for w in want[:3]] == [True] * 3  # stops hit


def test_streaming_sends_several_tokens_per_chunk(tiny, reference) -> None:
    _, model_dir = tiny
    llm = spec_llm(model_dir, num_blocks=512)
    engine = llm.engine
    i = max(range(len(reference)), key=lambda j: len(set(reference[j])) < 12)
    engine.add_request("s", prompts()[i], GREEDY)
    chunks: list[list[int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            chunks.append(out.outputs[0].token_ids)
    assert [t for c in chunks for t in c] == reference[i]
    assert max(len(c) for c in chunks) > 1


def test_requests_that_do_not_speculate_produce_the_same_output(tiny) -> None:
    _, model_dir = tiny
    base = LLM(str(model_dir), num_blocks=512)
    llm = spec_llm(model_dir, num_blocks=512)
    ps = prompts(4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.8),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex="(ab|cd){1,6}"),
        ),
    ]
    want = base.generate(ps, params, use_tqdm=False)
    got = llm.generate(ps, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert llm.engine.get_stats().spec_decode_num_drafts == 0


def test_sampled_tokens_keep_the_target_distribution(tiny) -> None:
    """Chi-square: the 2nd token of many sampled requests (verified against an n-gram
    draft whenever the 1st token occurs in the prompt) against its distribution computed
    from mlx-lm's softmax: P(t2) = sum over t1 of P(t1) P(t2 | t1)."""
    oracle, model_dir = tiny
    temperature, num_samples = 0.15, 2000
    prompt = [278] + [344] * 10  # sharp enough at this temperature for drafts to pass

    def softmax(logits: mx.array) -> np.ndarray:
        x = np.array(logits.astype(mx.float32)) / temperature
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p1 = softmax(oracle(mx.array([prompt]))[0, -1])  # (V,)
    p2 = softmax(oracle(mx.array([prompt + [t] for t in range(VOCAB_SIZE)]))[:, -1])  # (V, V)
    llm = LLM(
        str(model_dir),
        max_num_seqs=256,
        seed=0,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 1,
            "prompt_lookup_min": 1,
            "disable_by_batch_size": 256,
            "disable_by_cost": False,
        },
    )
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * num_samples, params, use_tqdm=False)
    first = np.array([o.outputs[0].token_ids[0] for o in outs])
    second = np.array([o.outputs[0].token_ids[1] for o in outs])
    stats = llm.engine.get_stats()
    # Both paths ran many times: drafts accepted and drafts replaced.
    assert stats.spec_decode_num_accepted_tokens > num_samples // 5
    assert stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens > 200
    assert_fits(np.bincount(first, minlength=VOCAB_SIZE), p1)
    assert_fits(np.bincount(second, minlength=VOCAB_SIZE), p1 @ p2)


@pytest.mark.parametrize(
    ("draft_cost", "pays"),
    [(2.0, False), (-0.1, True)],
    ids=["drafts-cost-more", "drafts-pay"],
)
def test_cost_backoff_follows_the_cost_per_token(tiny, draft_cost: float, pays: bool) -> None:
    """With a made-up clock (a step costs 1 s plus ``draft_cost`` s per draft), the engine
    keeps speculating where drafts make tokens cheaper and stops where they make them
    dearer, probing now and then; greedy output is the same either way."""
    _, model_dir = tiny
    llm = LLM(str(model_dir), speculative_config=SPEC | {"disable_by_cost": True}, num_blocks=512)
    sched = llm.engine.scheduler
    now = [0.0]
    sched.spec.clock = lambda: now[0]
    schedule = sched.schedule

    def schedule_and_charge():
        so = schedule()
        now[0] += 1.0 + draft_cost * sum(len(d) for d in so.draft_token_ids.values())
        return so

    sched.schedule = schedule_and_charge
    cost = sched.spec.cost
    observe, seen = cost.observe, []  # (step verified drafts, speculation on after it)

    def record(batch: int, speculated: bool, seconds: float, tokens: int, context: int) -> None:
        observe(batch, speculated, seconds, tokens, context)
        seen.append((speculated, cost.is_on(batch, context)))

    cost.observe = record
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    ps = [prompts()[0]]
    assert greedy(llm, ps, params) == greedy(LLM(str(model_dir), num_blocks=512), ps, params)
    assert sum(s for s, _ in seen) >= MIN_STEPS  # it did speculate, at first at least
    assert [state.is_on for state in cost.buckets.values()] == [pays]  # batch 1, < 512
    assert cost.num_switches == (0 if pays else 1)
    if not pays:  # after the switch, drafts only in probes: short runs, far apart
        after = [s for s, _ in seen[[on for _, on in seen].index(False) :]]
        text = "".join("s" if s else "." for s in after)
        assert all(len(run) <= PROBE_STEPS for run in text.split(".") if run), text
        assert text.count("s") <= PROBE_STEPS * (1 + len(after) // PROBE_INTERVAL), text


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "eagle"}, "speculative_config.method"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
        ),
        ({"method": "ngram", "typo": 1}, "speculative_config.typo"),
        ({"method": "ngram", "disable_by_cost": "yes"}, "speculative_config.disable_by_cost"),
        ({"num_speculative_tokens": 3}, "speculative_config.method"),
        ('{"method": ', "speculative_config"),
        ([1, 2], "speculative_config"),
    ],
)
def test_bad_speculative_config_names_the_field(config, field) -> None:
    from mlxserve.config import EngineConfig

    with pytest.raises(ParameterError) as e:
        EngineConfig(speculative_config=config)
    assert e.value.parameter == field
    assert field.rpartition(".")[2] in str(e.value)
