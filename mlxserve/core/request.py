"""Request (the engine's view of one generation) and RequestOutput (the user's view)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mlxserve.structured_output.grammar import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # a step failed because of this request (see ModelRunner.collect)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated: its tokens, progress and status.

    ``num_computed_tokens`` counts tokens whose K/V are in the block pool (cached or
    computed); the scheduler advances it, the KV cache manager reads it.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "max_tokens",
        "output_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_stored_tokens",
        "num_preemptions",
        "status",
        "stop_reason",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "pooling",
        "structured_output",
        "spec_token_ids",
        "spec_acceptance",
        "spec_paused_until",
        "num_drafter_tokens",
        "num_output_placeholders",
        "num_uncollected_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        structured_output: StructuredOutputRequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # The effective cap: SamplingParams.max_tokens, or what max_model_len leaves.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # -1 until first scheduled (prefix cache lookup)
        self.num_stored_tokens = 0  # of those, loaded from the store (the disk tier)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.block_hashes: list[bytes] = []  # full-block hashes, filled by the KV cache manager
        # Mixed into the first block's hash: only requests with the same salt share a prefix.
        self.cache_salt = cache_salt
        # An embedding request: "last" or "mean" pooling of the prompt's final hidden states.
        # It computes its prompt (prefill only), then finishes with a vector and no token.
        self.pooling: str | None = None
        # The compiled constraint (structured outputs); the runner keeps the grammar state.
        self.structured_output = structured_output
        # Speculative decoding: the drafts scheduled for verification this step (never
        # part of output_token_ids), a moving average of the fraction of drafts accepted,
        # and the output length before which the request proposes nothing (back-off).
        self.spec_token_ids: list[int] = []
        self.spec_acceptance = 1.0
        self.spec_paused_until = 0
        # A draft model's own KV (same slots as the target's): positions it has computed
        # for this request; it never reads blocks it did not write for this request.
        self.num_drafter_tokens = 0
        # Async scheduling (core/scheduler.py): tokens this request samples in steps that are
        # scheduled but whose output update_from_output has not seen yet (their values are
        # still on the device), and the tokens fed in those steps (their K/V not yet known
        # to be written: never hashed into the prefix cache before then).
        self.num_output_placeholders = 0
        self.num_uncollected_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


# A logprobs entry for one position: token id -> logprob (the chosen token and the top-k).
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request (time.monotonic seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """What LLM.generate returns and the engine streams, shaped like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Set when the request failed (its samples end with finish_reason "error"): what
    # went wrong. Other requests of the same batch are not affected.
    error: str | None = None
    # An embedding request's vector (pooled, truncated to its dimensions, normalized).
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """An embedding vector (vLLM's name)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, shaped like vLLM's: ``out.outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
