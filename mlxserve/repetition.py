"""Degenerate repetition: notice when generated tokens have started looping.

A small model decoding greedily (and sometimes sampling) falls into a loop: one sentence,
or a few words, over and over until the context is full. :class:`LoopDetector` watches a
token stream and reports once its tail is one block of ``period`` tokens repeated:

    ... a b c [x y z][x y z][x y z][x y z]      period 3, found at the 4th copy
              ^ start                           (and at least ``min_span`` tokens in all)

Incremental and cheap: for each period p it keeps how many tokens in a row have equalled
the token p places back; a new token only touches the periods at which the same token
occurred within the last ``max_period`` tokens. It is a leaf module (no package imports)
so a front-end (``mlxserve run``) or an output processor can use it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Defaults: a block of up to 256 tokens (a paragraph) repeated 3 times in a row, covering
# at least 64 tokens (so "ha ha ha" or a short table rule is not a loop, but a phrase
# repeated 16+ times or a sentence 3 times is).
MAX_PERIOD = 256
MIN_REPEATS = 3
MIN_SPAN = 64


@dataclass(frozen=True)
class Loop:
    """A repeated block at the end of the stream: tokens[start:] has this period."""

    start: int  # index of the first token of the first copy
    period: int
    num_tokens: int  # tokens in the stream when it was found

    @property
    def num_repeats(self) -> float:
        """How many copies of the block the looping tail holds."""
        return (self.num_tokens - self.start) / self.period

    @property
    def keep(self) -> int:
        """Tokens worth keeping: everything up to the end of the first copy."""
        return self.start + self.period


class LoopDetector:
    """Feed tokens with :meth:`add`; it returns a :class:`Loop` once the tail loops."""

    def __init__(
        self, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS, min_span: int = MIN_SPAN
    ) -> None:
        if max_period < 1 or min_repeats < 2 or min_span < 2:
            raise ValueError(
                f"need max_period >= 1, min_repeats >= 2, min_span >= 2; got "
                f"{max_period}, {min_repeats}, {min_span}"
            )
        self.max_period = max_period
        self.min_repeats = min_repeats
        self.min_span = min_span
        self.num_tokens = 0
        # period p -> how many of the latest tokens in a row equal the token p places back
        self._runs: dict[int, int] = {}
        # token -> its positions among the last max_period tokens (oldest first)
        self._seen: dict[int, deque[int]] = {}

    def add(self, token: int) -> Loop | None:
        """Append one token; the loop its arrival completes, if any (smallest period)."""
        n = self.num_tokens
        positions = self._seen.setdefault(token, deque())
        while positions and n - positions[0] > self.max_period:
            positions.popleft()
        runs = {n - j: self._runs.get(n - j, 0) + 1 for j in positions}
        positions.append(n)
        self._runs = runs
        self.num_tokens = n + 1
        found = None
        for period, run in runs.items():
            span = run + period  # the tail that repeats with this period
            if span >= self.min_repeats * period and span >= self.min_span:
                if found is None or period < found.period:
                    found = Loop(self.num_tokens - span, period, self.num_tokens)
        return found

    def extend(self, tokens: list[int]) -> Loop | None:
        """:meth:`add` each token; the first loop found (the rest are not added)."""
        for t in tokens:
            loop = self.add(t)
            if loop is not None:
                return loop
        return None
