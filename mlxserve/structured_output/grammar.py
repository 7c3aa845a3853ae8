"""Grammars for constrained decoding, on llguidance: compile once, one state per request.

    StructuredOutputsParams --GrammarCompiler.compile--> Grammar        (checked, cached)
    Grammar --new_state(end_token_ids)--> GrammarState                 (one per engine request)
    each step: GrammarState.fill_bitmask(row)   allowed tokens, one bit each (host, numpy)
               GrammarState.accept(token)       advance with the sampled token

Why llguidance (bench/grammar_backends.py on SmolLM2's 49,152-token vocabulary; numbers in
bench/README.md, "Structured outputs"): it compiles schemas fastest (1 ms for a nested
schema, 20-140 ms for 60 $defs, vs xgrammar's 106 ms / 875 ms and outlines-core's 1.9 s /
7.8 s for only 8 $defs), it refuses the JSON-schema keywords it does not implement by name
("Unimplemented keys": `not`, `uniqueItems`, `contains`, `if`/`then`/`else`), so the request
gets a 400, where xgrammar compiles `not`, `uniqueItems` and `if`/`then`/`else` and then
accepts instances that violate them, and it needs no torch or transformers (xgrammar
depends on both and imports them). xgrammar's masks are faster per token (7 us vs tens
to hundreds of us mean), but the mask is computed while the forward pass runs, and one
step of 32 requests costs both well under a millisecond. outlines-core has no
context-free grammars.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import numpy as np

from mlxserve.exceptions import ParameterError
from mlxserve.structured_output.emptiness import unproductive_start
from mlxserve.structured_output.params import StructuredOutputsParams
from mlxserve.structured_output.sources import describe_error, grammar_text, lark_of

# Compiled grammars kept for reuse (agents send the same schema and tools every turn).
CACHE_SIZE = 128


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (bit t % 32 of word t // 32 is token t)."""
    return (vocab_size + 31) // 32


class Grammar:
    """A compiled, checked constraint; immutable, shared by the requests that use it."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer):
        self._matcher = matcher  # never advanced: each state starts from a deep copy
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token

    def new_state(
        self, end_token_ids: frozenset[int], starts_after: bytes | None = None
    ) -> GrammarState:
        """A fresh state for one engine request (see GrammarState)."""
        return GrammarState(self, self._matcher.deep_copy(), end_token_ids, starts_after)


class GrammarState:
    """One request's position in its grammar.

    ``end_token_ids`` are the tokens that end the request (its eos and stop token ids):
    they are allowed exactly when the grammar can end, and never fed to the grammar.
    With ``starts_after`` (e.g. ``b"</think>"``) the output is free until that text has
    been generated; the grammar applies from the token after the one that completes it.
    """

    __slots__ = ("grammar", "matcher", "end_token_ids", "_trigger", "_tail")

    def __init__(
        self,
        grammar: Grammar,
        matcher: llguidance.LLMatcher,
        end_token_ids: frozenset[int],
        starts_after: bytes | None,
    ) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self.end_token_ids = end_token_ids
        self._trigger = starts_after or None
        self._tail = b""  # the output's last bytes while waiting for the trigger

    @property
    def is_active(self) -> bool:
        """True once the grammar constrains the output (at once, or after starts_after)."""
        return self._trigger is None

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing can follow: only an end token may come."""
        return self.is_active and self.matcher.is_stopped()

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; ValueError if the grammar rejects it."""
        if self._trigger is not None:
            tail = self._tail + self.grammar.tokenizer.decode_bytes([token_id])
            if self._trigger in tail:
                self._trigger = None
            self._tail = tail[-len(self._trigger or b"") :] if self._trigger else b""
            return
        if token_id in self.end_token_ids or self.matcher.is_stopped():
            return  # the request ends here (a step in flight may still sample once more)
        if not self.matcher.consume_token(token_id):
            # llguidance's error carries a dump of its state after the first line.
            error = self.matcher.get_error().strip().split("\n", 1)[0]
            raise ValueError(
                f"the output constraint rejected token {token_id}, which the sampler picked "
                f"under the constraint's own mask ({error})"
            )

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32 words, every bit set on entry).

        Rows of inactive states are left as they are (every token allowed).
        """
        if self._trigger is not None:
            return
        m = self.matcher
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if m.is_error():
            raise ValueError(f"the grammar failed: {m.get_error()}")
        can_end = _bit(row, self.grammar.eos_token_id)
        for tok in self.end_token_ids | {self.grammar.eos_token_id}:
            _set_bit(row, tok, can_end)
        if not can_end and not row.any():
            raise ValueError("the grammar allows no token here")


def fill_bitmasks(states: list[GrammarState | None], vocab_size: int) -> np.ndarray:
    """(len(states), words) int32 bitmask of one step: every bit set in rows without a
    grammar (or whose grammar has not started), the grammar's allowed tokens elsewhere."""
    bitmask = np.full((len(states), bitmask_words(vocab_size)), -1, dtype=np.int32)
    for row, state in zip(bitmask, states, strict=True):
        if state is not None:
            state.fill_bitmask(row)
    return bitmask


def _bit(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


def _set_bit(row: np.ndarray, token_id: int, value: bool) -> None:
    word, bit = token_id >> 5, token_id & 31
    if word >= row.shape[0]:
        return
    unsigned = int(row[word]) & 0xFFFFFFFF
    unsigned = unsigned | (1 << bit) if value else unsigned & ~(1 << bit)
    row[word] = np.uint32(unsigned).view(np.int32)


class GrammarCompiler:
    """Turns StructuredOutputsParams into Grammars for one model's tokenizer; thread-safe.

    Call compile() off the engine thread when you can: a large schema takes tens of ms.
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once, ~1 s for 49k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                eos = self.tokenizer.eos_token_id
                if eos is None:
                    raise ParameterError(
                        "structured outputs need a model with an end-of-sequence token",
                        parameter="structured_outputs",
                    )
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A checked Grammar for ``params``; ParameterError naming what is wrong."""
        key = params.cache_key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(params)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        kind = params.kind
        field = "json" if kind == "json_object" else kind
        parameter = f"structured_outputs.{field}"
        text = grammar_text(params, parameter)
        tok = self.ll_tokenizer()
        matcher = llguidance.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise ParameterError(describe_error(kind, matcher.get_error()), parameter=parameter)
        # A grammar whose start can never complete, or that allows no first token,
        # matches nothing: refuse it now rather than generate garbage until max_tokens.
        lark = lark_of(params)
        stuck = unproductive_start(lark) if lark is not None else None
        if stuck is not None:
            raise ParameterError(f"the {field} cannot match anything: {stuck}", parameter=parameter)
        probe = matcher.deep_copy()
        mask = np.zeros(bitmask_words(self.vocab_size), dtype=np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
            raise ParameterError(
                f"the {field} cannot match anything: no text can start it", parameter=parameter
            )
        return Grammar(matcher, tok)


class StructuredOutputRequest:
    """What an engine request carries about its constraint: the grammar, and from where
    in the output it applies (``starts_after``: a text, e.g. ``b"</think>"``)."""

    __slots__ = ("grammar", "starts_after")

    def __init__(self, grammar: Grammar, starts_after: bytes | None = None) -> None:
        self.grammar = grammar
        self.starts_after = starts_after

    def new_state(self, end_token_ids: frozenset[int]) -> GrammarState:
        """A fresh grammar state for one engine request."""
        return self.grammar.new_state(end_token_ids, self.starts_after)
