"""The n-gram proposer against a plain-loop search (the oracle)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxserve.core.ngram_proposer import NgramProposer


def naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Longest n in [lo, hi]: the latest earlier occurrence of the last n tokens (at least
    one token after it); the k tokens that follow it."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_examples() -> None:
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert p.propose([1, 2, 3, 4, 5], 3) == []
    assert p.propose([7, 8, 9, 7, 8, 1, 7, 8], 2) == [1, 7]  # the latest occurrence
    assert p.propose([5, 5, 5, 5], 4) == [5]  # it overlaps the suffix, one token follows
    # Packed bytes of 256 and 1 hold a misaligned copy of "1, 0": not a token match.
    assert p.propose([256, 1, 0, 0, 0, 1], 2) == [0, 0]
    assert NgramProposer(2, 3).propose([1, 2, 3, 1], 2) == []  # only 1-grams match


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 70000)), max_size=60),
    k=st.integers(0, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_matches_a_plain_search(tokens: list[int], k: int, lo: int, extra: int) -> None:
    hi = lo + extra
    assert NgramProposer(lo, hi).propose(tokens, k) == (naive(tokens, k, lo, hi) if k else [])
