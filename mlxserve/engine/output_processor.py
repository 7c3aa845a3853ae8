"""From engine Requests to user RequestOutputs: text, stop strings, logprobs, n samples.

A user request with n > 1 becomes n engine requests (engine/parallel_sampling.py owns
the fan-out); the output processor gathers them back into one RequestOutput with n
CompletionOutputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxserve.core.request import (
    CompletionOutput,
    Logprobs,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from mlxserve.engine.parallel_sampling import ParallelSampling, ParentRequest
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams
from mlxserve.tokenizer import TextStream


@dataclass
class SampleState:
    """One of the n samples: its text stream and what has been produced so far."""

    index: int
    stream: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Text already handed to a streaming consumer (delta outputs).
    num_text_sent: int = 0
    num_tokens_sent: int = 0


@dataclass
class RequestState:
    """A user request as the output processor tracks it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed (its samples end with "error")
    pooling: PoolingParams | None = None  # an embedding request
    embedding: list[float] | None = None  # its vector, once computed

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Detokenizes new tokens, applies stop strings, builds RequestOutputs."""

    def __init__(self, tokenizer, fanout: ParallelSampling) -> None:
        self.tokenizer = tokenizer
        self.fanout = fanout  # engine id -> (user request, sample index)
        self.states: dict[str, RequestState] = {}

    def add(
        self,
        parent: ParentRequest,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
    ) -> None:
        """Track a user request (whose n samples ``parent`` has fanned out)."""
        params = parent.params
        samples = []
        for i in range(params.n):
            stream = TextStream.for_request(self.tokenizer, params, prompt_token_ids)
            samples.append(
                SampleState(
                    i,
                    stream,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        self.states[parent.request_id] = RequestState(
            parent.request_id,
            prompt,
            prompt_token_ids,
            params,
            samples,
            RequestMetrics(arrival_time),
        )

    def metrics_of(self, engine_id: str) -> RequestMetrics | None:
        parent = self.fanout.parent_of(engine_id)
        state = None if parent is None else self.states.get(parent.request_id)
        return None if state is None else state.metrics

    def process(
        self,
        request: Request,
        new_token_ids: list[int],
        logprobs: list[Logprobs] | None,
        prompt_logprobs: list[Logprobs | None] | None,
    ) -> tuple[RequestState, bool]:
        """Fold one engine request's step into its user request.

        Returns (state, hit_stop_string): on a stop string the caller must finish the
        engine request (it is still running in the scheduler).
        """
        parent, index = self.fanout.owner(request.request_id)
        state = self.states[parent.request_id]
        sample = state.samples[index]
        now = time.monotonic()
        m = state.metrics
        if request.num_cached_tokens > 0 and index == 0:
            state.num_cached_tokens = request.num_cached_tokens
        if prompt_logprobs is not None:
            state.prompt_logprobs = prompt_logprobs
        hit_stop = False
        if new_token_ids:
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if sample.logprobs is None:
                logprobs = None
            # The scheduler stops on eos / stop token ids: that token is not part of the text.
            stopped_on_token = request.status == RequestStatus.FINISHED_STOPPED
            # Token by token: a stop string among several (speculative) tokens ends the
            # output at the token that completes it, as if they had come one at a time.
            for i, token in enumerate(new_token_ids):
                sample.token_ids.append(token)
                if logprobs is not None:  # one entry per token (drafts accepted: several)
                    sample.logprobs.append(logprobs[i])
                    sample.cumulative_logprob += logprobs[i][token]
                is_last = i == len(new_token_ids) - 1
                if not (is_last and stopped_on_token):
                    sample.stream.step((token,))
                if sample.stream.stopped:
                    break
            if sample.stream.stopped:
                # Also when this was the last token allowed (length): the stop string
                # completed, so the answer ends there with "stop", as vLLM's.
                hit_stop = not request.is_finished
                self.finish_sample(request.request_id, "stop", sample.stream.stop_str)
        if request.is_finished and sample.finish_reason is None:
            reason = request.status.finish_reason
            sample.stream.finish()
            self.finish_sample(request.request_id, reason, request.stop_reason)
        return state, hit_stop

    def finish_sample(self, engine_id: str, reason: str, stop_reason: int | str | None) -> None:
        parent, index = self.fanout.owner(engine_id)
        self._finish(self.states[parent.request_id], index, reason, stop_reason)

    def _finish(
        self, state: RequestState, index: int, reason: str, stop_reason: int | str | None
    ) -> None:
        sample = state.samples[index]
        if sample.finish_reason is None:
            if reason != "stop" or not sample.stream.stopped:
                sample.stream.finish()
            sample.finish_reason = reason
            sample.stop_reason = stop_reason
        if state.finished:
            state.metrics.finished_time = time.monotonic()

    def abort(self, request_id: str, error: str | None = None) -> RequestState | None:
        """End every unfinished sample of a user request: "abort", or "error" with ``error``."""
        state = self.states.get(request_id)
        if state is None:
            return None
        if error is not None:
            state.error = error
        for s in state.samples:
            if s.finish_reason is None:
                self._finish(state, s.index, "abort" if error is None else "error", None)
        return state

    def make_output(self, state: RequestState, delta: bool = False) -> RequestOutput:
        """A RequestOutput: cumulative, or only what is new since the last delta."""
        outputs = []
        for s in state.samples:
            text, tokens = s.stream.text, s.token_ids
            logprobs = s.logprobs
            if delta:
                text, tokens = text[s.num_text_sent :], tokens[s.num_tokens_sent :]
                if logprobs is not None:
                    logprobs = logprobs[s.num_tokens_sent :]
                s.num_text_sent += len(text)
                s.num_tokens_sent += len(tokens)
            outputs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(tokens),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            error=state.error,
            embedding=state.embedding,
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
