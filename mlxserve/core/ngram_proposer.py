"""N-gram (prompt lookup) proposer: drafts copied from earlier in the request's own tokens.

The sequence's last n tokens are looked up in the tokens before them (latest occurrence
first); the tokens that followed that occurrence become the drafts::

    tokens: ... a b c d e ... x y a b c | ?       last 3 tokens "a b c" seen before
    drafts:                               d e ..  what followed them there

n goes from ``prompt_lookup_max`` down to ``prompt_lookup_min``: a longer match is a
better predictor. Code edits, quoting and agents repeating their context make such
matches common; free chat rarely does (then nothing is proposed, at no cost).

The search runs on the tokens packed as 4-byte little-endian words with ``bytes.rfind``
(C speed); a match at an offset that is not a multiple of 4 is not a token match and the
search goes on to the left of it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WORD = 4  # bytes per packed token id


class NgramProposer:
    """Proposes up to k drafts for a sequence from its own earlier tokens."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, (prompt_lookup_min, prompt_lookup_max)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most k drafts to follow ``token_ids`` ([] when no n-gram matches)."""
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < self.prompt_lookup_min + 1:
            return []
        packed = array("i", token_ids).tobytes()
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            start = _rfind_token_run(packed, num_tokens - n, n)
            if start is not None:
                follow = start + n
                return list(token_ids[follow : follow + k])
        return []


def _rfind_token_run(packed: bytes, suffix_start: int, n: int) -> int | None:
    """Token index of the latest earlier occurrence of the n tokens at ``suffix_start``
    (the sequence's last n), such that at least one token follows it; None if none."""
    needle = packed[suffix_start * _WORD :]
    # The occurrence must end before the last token: it starts at most at suffix_start - 1.
    end = (suffix_start - 1 + n) * _WORD
    while end >= len(needle):
        at = packed.rfind(needle, 0, end)
        if at < 0:
            return None
        if at % _WORD == 0:
            return at // _WORD
        end = at + len(needle) - 1  # a misaligned hit: look further left
    return None
