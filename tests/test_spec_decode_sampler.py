"""The sampler's draft verification (rejection sampling) against numpy's softmax.

A row with a draft x yields x when accepted, else its (replacement) token; either way the
token must be distributed as the row's target distribution p, whatever x is.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.sampling_params import SamplingParams
from mlxserve.worker.sampler import SamplingState, make_sampling_batch, sample
from tests.chi_square import assert_fits, chi_square, chi_square_critical

LOGITS = np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003]))
V = len(LOGITS)
N = 3000


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def verified_tokens(states: list[SamplingState], drafts: list[int]) -> tuple[list[int], list[bool]]:
    """Each row's resulting token (its draft if accepted) and whether it was accepted."""
    logits = mx.array(np.tile(LOGITS, (len(states), 1)).astype(np.float32))
    out = sample(logits, make_sampling_batch(states, V), mx.array(drafts, dtype=mx.int32))
    mx.eval(out.token_ids, out.accepted)
    tokens = np.array(out.token_ids).tolist()
    accepted = np.array(out.accepted).tolist()
    return [d if a else t for d, t, a in zip(drafts, tokens, accepted, strict=True)], accepted


def test_chi_square_critical_values() -> None:
    # Tables: chi2.ppf(0.999, df) = 16.27 (3), 29.59 (10), 45.31 (20).
    for df, want in ((3, 16.27), (10, 29.59), (20, 45.31)):
        assert abs(chi_square_critical(df) - want) / want < 0.02
    stat, df = chi_square(np.array([50, 50]), np.array([0.5, 0.5]))
    assert stat == 0.0 and df == 1


@pytest.mark.parametrize(
    ("draft", "params"),
    [
        (0, {}),  # the likeliest token, accepted 30% of the time
        (5, {}),  # an unlikely one
        (2, {"temperature": 0.6}),
        (0, {"top_k": 4}),
        (9, {"top_p": 0.8}),  # outside the top-p set: p(x) = 0, always rejected
    ],
)
def test_sampled_verification_keeps_the_target_distribution(draft: int, params: dict) -> None:
    sp = SamplingParams(temperature=params.pop("temperature", 1.0), **params)
    states = [SamplingState(sp, seed, []) for seed in range(N)]
    tokens, accepted = verified_tokens(states, [draft] * N)
    # The oracle: numpy's softmax of the filtered logits at the temperature.
    target = softmax(LOGITS / sp.temperature)
    if sp.top_k:
        target[np.argsort(-target)[sp.top_k :]] = 0
    if sp.top_p < 1.0:
        order = np.argsort(-target)
        before = np.cumsum(target[order]) - target[order]
        target[order[before >= sp.top_p]] = 0
    target /= target.sum()
    assert_fits(np.bincount(tokens, minlength=V), target)
    # Acceptance itself happens at rate p(x) (binomial, 4 sigma).
    rate, p = sum(accepted) / N, target[draft]
    assert abs(rate - p) <= 4 * np.sqrt(p * (1 - p) / N) + 1e-9


def test_replacing_a_rejected_draft_with_a_plain_sample_is_caught() -> None:
    # The test above has the power to see the classic bug: after a rejection, sampling
    # from p itself (x not removed) makes x likelier than p(x) (p + (1 - p) p).
    p = softmax(LOGITS)
    rng = np.random.default_rng(0)
    tokens = [0 if rng.random() < p[0] else int(rng.choice(V, p=p)) for _ in range(N)]
    stat, df = chi_square(np.bincount(tokens, minlength=V), p)
    assert stat > chi_square_critical(df)


def test_greedy_rows_accept_only_the_argmax_and_mixed_rows_agree() -> None:
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0)
    states = [SamplingState(greedy, 0, []), SamplingState(greedy, 0, [])]
    states += [SamplingState(sampled, 7, []), SamplingState(greedy, 0, [])]
    tokens, accepted = verified_tokens(states, [0, 3, 0, -1])
    assert accepted[:2] == [True, False] and tokens[:2] == [0, 0]
    assert tokens[3] == 0  # no draft: the plain argmax
    # The sampled row matches the same row sampled alone (batch invariance).
    alone, _ = verified_tokens([SamplingState(sampled, 7, [])], [0])
    assert alone == [tokens[2]]


def test_rows_without_drafts_sample_as_without_verification() -> None:
    sp = SamplingParams(temperature=1.0)
    states = [SamplingState(sp, seed, []) for seed in range(64)]
    logits = mx.array(np.tile(LOGITS, (64, 1)).astype(np.float32))
    plain = sample(logits, make_sampling_batch(states, V)).token_ids
    checked = sample(logits, make_sampling_batch(states, V), mx.full((64,), -1, mx.int32))
    assert np.array(plain).tolist() == np.array(checked.token_ids).tolist()
    assert not np.array(checked.accepted).any()


def test_a_draft_row_sees_min_tokens_as_many_outputs_later() -> None:
    # min_tokens=2 masks the stop token 0 for outputs 0 and 1: a draft of 0 at output 1
    # is rejected, at output 2 it can be the argmax again.
    sp = SamplingParams(temperature=0.0, min_tokens=2)
    base = SamplingState(sp, 0, [], stop_ids=frozenset({0}))
    base.append(5)
    tokens, accepted = verified_tokens([base.ahead(0), base.ahead(1)], [0, 0])
    assert accepted == [False, True] and tokens[0] == 1
