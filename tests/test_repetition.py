"""LoopDetector against a brute-force oracle: the first token at which a stream loops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxserve.repetition import Loop, LoopDetector


def brute_force_first_loop(
    tokens: list[int], max_period: int, min_repeats: int, min_span: int
) -> Loop | None:
    """Re-examine every prefix from scratch: for each period, the longest tail that
    repeats with it, compared token by token."""
    for n in range(1, len(tokens) + 1):
        for period in range(1, min(max_period, n - 1) + 1):
            i = n - 1
            while i - period >= 0 and tokens[i] == tokens[i - period]:
                i -= 1
            span = (n - 1 - i) + period  # matching positions + the first copy
            if span > n:
                continue
            if span >= min_repeats * period and span >= min_span:
                return Loop(n - span, period, n)
    return None


def first_loop(detector: LoopDetector, tokens: list[int]) -> Loop | None:
    return detector.extend(tokens)


def with_planted_loop(rng: np.random.Generator, vocab: int) -> list[int]:
    """Random tokens, then a block repeated, then more random tokens."""
    prefix = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
    block = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
    copies = int(rng.integers(1, 8))
    return prefix + block * copies + rng.integers(0, vocab, 20).tolist()


@pytest.mark.parametrize("seed", range(40))
def test_first_loop_matches_the_brute_force_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([2, 3, 5, 50]))  # tiny vocabularies repeat by chance too
    tokens = with_planted_loop(rng, vocab)
    params = dict(max_period=int(rng.integers(1, 40)), min_repeats=3, min_span=12)
    want = brute_force_first_loop(tokens, **params)
    assert first_loop(LoopDetector(**params), tokens) == want


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=120),
    max_period=st.integers(1, 20),
    min_repeats=st.integers(2, 5),
    min_span=st.integers(2, 30),
)
def test_any_stream_matches_the_oracle(tokens, max_period, min_repeats, min_span) -> None:
    params = dict(max_period=max_period, min_repeats=min_repeats, min_span=min_span)
    assert first_loop(LoopDetector(**params), tokens) == brute_force_first_loop(tokens, **params)


def test_a_sentence_repeated_is_found_at_its_third_copy_and_kept_once() -> None:
    intro = list(range(100, 130))  # 30 distinct tokens
    sentence = list(range(1, 26))  # 25 tokens: 3 copies = 75 >= min_span 64
    tokens = intro + sentence * 5
    loop = LoopDetector().extend(tokens)
    assert loop == Loop(start=30, period=25, num_tokens=30 + 75)
    assert loop.num_repeats == 3
    assert tokens[: loop.keep] == intro + sentence


def test_short_repeats_need_the_minimum_span() -> None:
    """'ha ha ha' or a table rule is not a loop; the same two tokens 32 times are."""
    detector = LoopDetector()
    assert detector.extend([7, 8] * 31 + [9]) is None
    detector = LoopDetector()
    loop = detector.extend([5] + [7, 8] * 32)
    assert loop is not None and (loop.start, loop.period, loop.num_tokens) == (1, 2, 65)


def test_no_loop_in_text_without_repeats() -> None:
    rng = np.random.default_rng(0)
    assert LoopDetector().extend(rng.permutation(5000).tolist()) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_repeats >= 2"):
        LoopDetector(min_repeats=1)
