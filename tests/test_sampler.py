"""The batched sampler against numpy references and sampling statistics."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.sampling_params import SamplingParams
from mlxserve.worker.sampler import (
    SamplingState,
    apply_logits_processors,
    make_sampling_batch,
    sample,
)

V = 12


def state(seed: int = 0, prompt=(), outputs=(), stop_ids=(), **kw) -> SamplingState:
    s = SamplingState(SamplingParams(**kw), seed, list(prompt), stop_ids=frozenset(stop_ids))
    for t in outputs:
        s.append(t)
    return s


def run(logits: np.ndarray, states: list[SamplingState]):
    out = sample(mx.array(logits), make_sampling_batch(states, logits.shape[-1]))
    mx.eval(out.token_ids)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


LOGITS = np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003]))


def sample_many(n: int, **kw) -> np.ndarray:
    """n independent draws: each row its own seed."""
    logits = np.tile(LOGITS, (n, 1)).astype(np.float32)
    return np.array(run(logits, [state(seed=i, **kw) for i in range(n)]).token_ids)


def test_greedy_is_argmax() -> None:
    logits = np.random.default_rng(0).standard_normal((5, V)).astype(np.float32)
    out = run(logits, [state(temperature=0.0) for _ in range(5)])
    assert np.array(out.token_ids).tolist() == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_softmax() -> None:
    n, temp = 6000, 0.7
    draws = sample_many(n, temperature=temp)
    freq = np.bincount(draws, minlength=V) / n
    expected = softmax(LOGITS / temp)
    # 4.5 standard errors per token: a wrong temperature or bias fails, noise does not.
    se = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) < 4.5 * se + 1e-3), (freq, expected)


def test_top_k_top_p_min_p_restrict_support() -> None:
    n = 3000
    assert set(sample_many(n, top_k=3).tolist()) == {0, 1, 2}
    # Nucleus for p=0.6: 0.3+0.2 = 0.5 < 0.6, add 0.15 -> {0, 1, 2}.
    assert set(sample_many(n, top_p=0.6).tolist()) == {0, 1, 2}
    # min_p 0.3 keeps probs >= 0.09: {0, 1, 2, 3}.
    assert set(sample_many(n, min_p=0.3).tolist()) == {0, 1, 2, 3}
    # top_k and top_p together: the stricter wins.
    assert set(sample_many(n, top_k=2, top_p=0.9).tolist()) == {0, 1}


def test_seeded_request_is_reproducible_alone_and_in_a_batch() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, V)).astype(np.float32)
    states = [state(seed=100 + i, temperature=1.0, outputs=[1] * i) for i in range(6)]
    batched = np.array(run(logits, states).token_ids)
    for i in range(6):
        alone = run(logits[i : i + 1], [states[i]])
        assert int(np.array(alone.token_ids)[0]) == batched[i]

    # Another seed gives another stream (over many steps, not equal everywhere).
    def stream(seed: int) -> list[int]:
        """The first 20 sampled tokens of a request with this seed."""
        one = [state(seed=seed, temperature=1.0, outputs=[0] * k) for k in range(20)]
        return [int(np.array(run(logits[:1], [s]).token_ids)[0]) for s in one]

    assert stream(1) != stream(2)


def reference_penalties(logits, prompt, outputs, rep, pres, freq):
    out = logits.copy()
    counts = np.bincount(outputs, minlength=len(logits)) if outputs else np.zeros(len(logits))
    for tok in range(len(logits)):
        if rep != 1.0 and (tok in prompt or counts[tok] > 0):
            out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
        out[tok] -= pres * (counts[tok] > 0) + freq * counts[tok]
    return out


def test_penalties_match_reference() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(V).astype(np.float32) * 3
    prompt, outputs = [0, 3, 5], [5, 7, 7, 7, 2]
    kw = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    want = reference_penalties(logits, prompt, outputs, 1.3, 0.5, 0.4)
    batch = make_sampling_batch([state(prompt=prompt, outputs=outputs, **kw)], V)
    got = np.array(apply_logits_processors(mx.array(logits[None]), batch))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_logit_bias_and_min_tokens() -> None:
    logits = np.tile(LOGITS, (2, 1)).astype(np.float32)
    out = run(
        logits,
        [
            state(temperature=0.0, logit_bias={9: 100.0}),
            state(temperature=0.0, logit_bias={"0": -100}),
        ],
    )
    assert np.array(out.token_ids).tolist() == [9, 1]
    # EOS (0 here) is masked until min_tokens outputs exist, then allowed again.
    early = run(logits[:1], [state(temperature=0.0, min_tokens=2, outputs=[4], stop_ids={0})])
    late = run(logits[:1], [state(temperature=0.0, min_tokens=2, outputs=[4, 4], stop_ids={0})])
    assert int(np.array(early.token_ids)[0]) == 1 and int(np.array(late.token_ids)[0]) == 0


def test_logprobs_are_raw_log_softmax_with_sorted_top_k() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 2
    states = [
        state(temperature=0.0, logprobs=5),
        state(seed=3, temperature=1.0, logprobs=0),
        state(temperature=0.0, logprobs=5, repetition_penalty=2.0, prompt=[1, 2]),
    ]
    out = run(logits, states)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens = np.array(out.token_ids)
    np.testing.assert_allclose(np.array(out.logprobs), ref[np.arange(3), tokens], atol=1e-5)
    top_ids = np.array(out.top_ids)
    for i in range(3):
        assert top_ids[i].tolist() == np.argsort(-ref[i])[:5].tolist()
    np.testing.assert_allclose(np.array(out.top_logprobs), -np.sort(-ref)[:, :5], atol=1e-5)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be > 0"),
        (dict(top_p=1.5), "top_p must be <= 1"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(min_p=2.0), "min_p must be <= 1"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens must be <= max_tokens"),
        (dict(logprobs=21), "logprobs must be <= 20"),
        (dict(n=0), "n must be >= 1"),
        (dict(presence_penalty=3), "presence_penalty must be <= 2"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
        (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be <= 100"),
        (dict(stop=[""]), "stop must be a list of non-empty strings"),
        (dict(seed="a"), "seed must be an integer"),
    ],
)
def test_bad_sampling_params_name_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
