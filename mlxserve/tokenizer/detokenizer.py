"""Streaming text out of token ids: incremental detokenization and stop strings.

IncrementalDetokenizer decodes only a small window per step (vLLM's prefix/read offsets):

    ids:  ... | prefix_offset ....... read_offset ....... end
                 \\_ already emitted _/  \\_ new tokens _/
    delta = decode(ids[prefix:end])[len(decode(ids[prefix:read])):]

The window keeps one emitted token in front so leading spaces (SentencePiece "▁", byte-level "Ġ")
decode as they do in the full text. A delta that ends in U+FFFD (an unfinished UTF-8 character)
is held back until later tokens complete it, so every emitted text is a prefix of the final decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxserve.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the first output tokens
_TRIM_AT = 256  # drop ids before prefix_offset once this many pile up


class IncrementalDetokenizer:
    """Token ids in, text deltas out; joined deltas equal `tokenizer.decode(all ids)`.

    With `prompt_token_ids`, the last few prompt tokens are decoded as context (never emitted), so
    the first output token keeps its leading space as it has in prompt + output; without them the
    deltas join to exactly ``decode(output_ids, skip_special_tokens)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Dropping skipped ids up front keeps windows from starting at an id decode() ignores.
        self._skipped = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self.text = ""  # everything emitted so far
        self.token_ids: list[int] = []  # every id received (unfiltered)
        self._ids: list[int] = []
        tail = list(prompt_token_ids or [])[-8 * _CONTEXT_TOKENS :]  # specials may drop out
        context = self._keep(tail)[-_CONTEXT_TOKENS:]
        # A context ending inside a UTF-8 character would shift the first delta; skip it then.
        if context and not self._decode(context).endswith(REPLACEMENT_CHAR):
            self._ids = context
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _keep(self, ids: Iterable[int]) -> list[int]:
        return [i for i in ids if i not in self._skipped]

    def step(self, new_token_ids: Iterable[int]) -> str:
        """Append new ids; return the text that is now final (may be empty)."""
        new_ids = list(new_token_ids)
        self.token_ids.extend(new_ids)
        kept = self._keep(new_ids)
        if not kept:
            return ""
        self._ids.extend(kept)
        return self._advance(final=False)

    def flush(self) -> str:
        """Generation ended: release held-back text (an unfinished character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text):
            return ""
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta


class StopChecker:
    """Stop strings over a text stream: truncates at the first stop, holds back possible starts.

    The winning stop string is the one whose match ends first, as if text arrived one character
    at a time (on a tie the longer match wins), so the result does not depend on how text is cut
    into deltas. Text that could be the start of a stop string is held back until it is not.
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_str: str | None = None  # the stop string that ended the stream
        self._held = ""

    @property
    def stopped(self) -> bool:
        """True once a stop string has been seen; later deltas are ignored."""
        return self.stop_str is not None

    @property
    def held_text(self) -> str:
        """Text kept back because it may begin a stop string."""
        return self._held

    def step(self, delta: str) -> str:
        """Feed new text; return the part that is safe to show now."""
        if self.stop_str is not None or not delta:
            return ""
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.stop_str, self._held = stop, ""
            return text[:start] + (stop if self.include_stop_str_in_output else "")
        keep = self._partial_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The stream ended without a stop: release the held-back tail."""
        held, self._held = self._held, ""
        return "" if self.stop_str is not None else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                key = (at + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class TextStream:
    """One request's output text: incremental detokenizer followed by stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids
        )
        self.stops = StopChecker(stop, include_stop_str_in_output)
        self.text = ""  # everything emitted so far

    @classmethod
    def for_request(
        cls, tokenizer: Tokenizer, params: Any, prompt_token_ids: Sequence[int] | None = None
    ) -> TextStream:
        """Build from SamplingParams (stop, include_stop_str_in_output, skip_special_tokens)."""
        return cls(
            tokenizer,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            prompt_token_ids=prompt_token_ids,
        )

    @property
    def stopped(self) -> bool:
        """True once a stop string ended the text."""
        return self.stops.stopped

    @property
    def stop_str(self) -> str | None:
        """The stop string that matched, if any."""
        return self.stops.stop_str

    def step(self, new_token_ids: Iterable[int]) -> str:
        """New ids in, newly visible text out; check `stopped` afterwards."""
        if self.stopped:
            return ""
        delta = self.stops.step(self.detokenizer.step(new_token_ids))
        self.text += delta
        return delta

    def finish(self) -> str:
        """Generation ended (EOS, length, abort): the remaining visible text."""
        if self.stopped:
            return ""
        delta = self.stops.step(self.detokenizer.flush())
        delta += self.stops.flush() if not self.stopped else ""
        self.text += delta
        return delta
