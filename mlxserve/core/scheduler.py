"""Scheduler: continuous batching under a per-step token budget, without prefill/decode phases.

Every step hands ``max_num_batched_tokens`` out, running requests first (oldest first),
then waiting ones (FCFS). A request gets the tokens it has not computed yet, capped by
what is left of the budget: one token when decoding, the next chunk of a long prompt
otherwise. So a long prompt is split over several steps while the decodes of other
requests keep going in the same forward passes::

    step budget 8:  | d0 | d1 | p2 p2 p2 p2 p2 p2 |   d = decode, p = chunk of a prompt

Decodes never starve prefills. Every request with one token left to compute (a decode)
gets it, and prefill chunks (of running requests, then of admitted waiting ones) share
what is left, but never less than half the budget, ``ceil(max_num_batched_tokens / 2)``.
With few decodes nothing changes (prefills get ``budget - num_decodes >= budget / 2``);
with more, the step grows past the budget just enough to decode them all::

    step tokens = num_decodes + max(budget - num_decodes, ceil(budget / 2))
                <= max(budget, num_decodes + ceil(budget / 2))

    budget 8, 10 decodes:  | d0 | d1 | ... | d9 | p p p p |   a waiting prompt still moves

A small budget (the CPU server's 32) keeps the streams' inter-token latency smooth: a
chunk costs little more than the decodes beside it. Without the floor, 32 running decodes
took the whole budget and a new prompt waited until a stream ended. The step is bounded
by ``max_num_seqs + ceil(budget / 2)`` tokens (decodes are running requests), and only
exceeds the budget when ``max_num_seqs`` does (the CPU server's 64 vs 32).

``num_computed_tokens`` is advanced when scheduling (the tokens will be in the KV cache
once the step runs). The engine loop alternates strictly: ``schedule()``, run the model,
``update_from_output()``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mlxserve.config import CacheConfig, SchedulerConfig
from mlxserve.core.kv_cache_manager import KVCacheManager, StateSlots
from mlxserve.core.request import Request, RequestStatus
from mlxserve.exceptions import ParameterError


def min_prefill_tokens(max_num_batched_tokens: int) -> int:
    """Prefill tokens a step offers however many decodes run: half the budget, rounded up."""
    return (max_num_batched_tokens + 1) // 2


@dataclass
class SchedulerOutput:
    """What the runner computes in one step.

    For each request ``r`` in ``scheduled_requests`` the runner feeds the tokens
    ``(r.prompt_token_ids + r.output_token_ids)[start : start + n]`` (``token_ids(r)``) at positions
    ``start .. start + n - 1``, where ``start = start_positions[r.request_id]`` (tokens
    already in the KV cache before this step) and ``n = num_scheduled_tokens[...]``. Its
    context after the step is ``start + n`` tokens; token at position p goes to slot
    ``block_ids[g][p // block_size] * block_size + p % block_size`` in each KV cache group
    g. Requests in ``sampling_request_ids`` sample one token from the logits of their last
    fed token. Models with recurrent layers also get each request's ``state_slots``.
    """

    # Batch order: the first num_decodes requests are decodes (one token, prompt done),
    # then prefill chunks (and prompt/recompute chunks of any length).
    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step
    total_num_scheduled_tokens: int
    # request_id -> its whole block table in each KV cache group, after allocation
    block_ids: dict[str, tuple[list[int], ...]]
    preempted_request_ids: list[str]
    finished_request_ids: list[str]  # finished/aborted since the previous schedule()
    start_positions: dict[str, int] = field(default_factory=dict)
    sampling_request_ids: set[str] = field(default_factory=set)
    num_decodes: int = 0
    state_slots: dict[str, StateSlots] = field(default_factory=dict)  # recurrent layers

    def token_ids(self, request: Request) -> list[int]:
        """The tokens the runner feeds for request this step."""
        start = self.start_positions[request.request_id]
        return request.get_token_ids(start, start + self.num_scheduled_tokens[request.request_id])

    def samples(self, request_id: str) -> bool:
        """True when the request's chunk reaches the end of its known tokens this step."""
        return request_id in self.sampling_request_ids

    def subset(self, requests: list[Request]) -> SchedulerOutput:
        """The same step for some of its requests only (batch order kept, nothing finished).

        A valid step on its own: each request's tokens depend only on its own tokens and
        blocks, so the runner re-runs subsets to find which request made a step fail.
        """
        ids = {r.request_id for r in requests}
        num_decodes = self.num_decodes
        kept = [r for r in self.scheduled_requests if r.request_id in ids]
        num_scheduled = {r.request_id: self.num_scheduled_tokens[r.request_id] for r in kept}
        return SchedulerOutput(
            scheduled_requests=kept,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_ids={rid: self.block_ids[rid] for rid in num_scheduled},
            preempted_request_ids=[],
            finished_request_ids=[],
            start_positions={rid: self.start_positions[rid] for rid in num_scheduled},
            sampling_request_ids=self.sampling_request_ids & ids,
            num_decodes=sum(r.request_id in ids for r in self.scheduled_requests[:num_decodes]),
            state_slots={rid: s for rid, s in self.state_slots.items() if rid in ids},
        )


@dataclass
class ModelRunnerOutput:
    """What the runner returns for one SchedulerOutput."""

    # request_id -> [new token]; [] (or absent) for a partial prefill chunk.
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, object] | None = None  # opaque here; passed through to the engine
    prompt_logprobs: dict[str, object] | None = None
    # request_id -> what went wrong, for requests whose step failed (they got no token).
    failed: dict[str, str] = field(default_factory=dict)
    # request_id -> pooled hidden state, for embedding requests whose prompt is done.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for logging and metrics; the counters are cumulative since start."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of usable blocks in use
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int


class Scheduler:
    """Decides, each step, which requests compute how many tokens; tracks their lifecycle."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.block_size,
            cache_config.num_blocks,
            cache_config.enable_prefix_caching,
            cache_config.initial_blocks,
            groups=cache_config.groups,
            num_state_slots=cache_config.num_state_slots,
            snapshot_interval=cache_config.snapshot_interval,
        )
        self.max_model_len = scheduler_config.max_model_len
        # The most tokens one request can hold alone (None: any, all layers windowed).
        self.num_pool_tokens = self.kv_cache_manager.max_request_tokens(
            scheduler_config.max_num_batched_tokens
        )
        # A request stops (length) at this many tokens: max_model_len, or when it would
        # no longer fit alone in the pool (its last sampled token needs no KV yet).
        self.max_num_tokens = self.max_model_len
        if self.num_pool_tokens is not None:
            self.max_num_tokens = min(self.max_model_len, self.num_pool_tokens + 1)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.finished_request_ids: list[str] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ lifecycle

    def add_request(self, request: Request) -> None:
        """Queue a new request; ParameterError if its prompt cannot fit the whole pool.

        The caller (LLMEngine.add_request) has checked the id and the prompt's length
        against max_model_len.
        """
        num_prompt = request.num_prompt_tokens
        assert request.request_id not in self.requests, request
        assert 1 <= num_prompt < self.max_model_len, (num_prompt, self.max_model_len)
        if self.num_pool_tokens is not None and num_prompt > self.num_pool_tokens:
            raise ParameterError(
                f"prompt has {num_prompt} tokens, but the whole KV cache holds "
                f"{self.num_pool_tokens} tokens ({self.kv_cache_manager.num_usable_blocks} "
                f"blocks of {self.block_size}); raise num_blocks or memory_fraction",
                parameter="prompt",
            )
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests now (stop string hit, client gone...) and free their blocks.

        Unknown or already finished ids are ignored.
        """
        assert status.is_finished, status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_request_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        # Recompute later from scratch: output tokens are kept, KV is dropped.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocate their blocks."""
        budget = self.scheduler_config.max_num_batched_tokens
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        # Decodes take one token each; prefill chunks get the rest, at least half the budget.
        prefill_budget = max(budget - num_decodes, min_prefill_tokens(budget))
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []

        # 1. Running requests, oldest first: a decode token or the next prompt chunk.
        index = 0
        while index < len(self.running):
            request = self.running[index]
            num_left = request.num_tokens - request.num_computed_tokens
            assert num_left >= 1, f"{request} has nothing to compute; missed update_from_output?"
            num_new = 1 if num_left == 1 else min(num_left, prefill_budget)
            index += 1
            if num_new == 0:
                continue  # prefill share spent; newer decodes still get their token
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request preempted itself: nothing newer is left to schedule
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            if num_left > 1:
                prefill_budget -= num_new

        # 2. Waiting requests, first come first served, unless memory just ran short.
        max_num_seqs = self.scheduler_config.max_num_seqs
        while (
            not preempted
            and self.waiting
            and prefill_budget > 0
            and len(self.running) < max_num_seqs
        ):
            request = self.waiting[0]
            hit, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, prefill_budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, hit) is None:
                break  # the head does not fit; later ones wait behind it (FCFS)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            prefill_budget -= num_new

        return self._make_output(scheduled, num_scheduled, preempted)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Allocate for a running request, preempting the newest ones until it fits.

        Returns False when the request itself had to be preempted.
        """
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _make_output(
        self, scheduled: list[Request], num_scheduled: dict[str, int], preempted: list[str]
    ) -> SchedulerOutput:
        start_positions: dict[str, int] = {}
        sampling: set[str] = set()
        decodes: list[Request] = []
        chunks: list[Request] = []
        for request in scheduled:
            rid = request.request_id
            start = start_positions[rid] = request.num_computed_tokens
            request.num_computed_tokens += num_scheduled[rid]
            if request.num_computed_tokens == request.num_tokens:
                sampling.add(rid)
            is_decode = num_scheduled[rid] == 1 and start >= request.num_prompt_tokens
            (decodes if is_decode else chunks).append(request)
        finished, self.finished_request_ids = self.finished_request_ids, []
        kv = self.kv_cache_manager
        state_slots = {}
        if kv.state_pool is not None:
            state_slots = {r.request_id: kv.get_state_slots(r) for r in scheduled}
        return SchedulerOutput(
            scheduled_requests=decodes + chunks,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_ids={r.request_id: kv.get_block_ids(r) for r in scheduled},
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            start_positions=start_positions,
            sampling_request_ids=sampling,
            num_decodes=len(decodes),
            state_slots=state_slots,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append sampled tokens, apply stop rules, cache full blocks, free finished requests.

        Returns the requests that got a new token (finished ones included) this step.
        """
        updated: list[Request] = []
        any_finished = False
        for request in scheduler_output.scheduled_requests:
            rid = request.request_id
            if request.is_finished:
                continue  # aborted after schedule(); its blocks are already free
            if request.pooling is not None:  # prefill only: done once the vector is out
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                if rid in model_runner_output.pooled:
                    request.status = RequestStatus.FINISHED_STOPPED
                    updated.append(request)
                    any_finished = True
                    self._release(request)
                continue
            new_token_ids = model_runner_output.sampled_token_ids.get(rid) or []
            assert len(new_token_ids) == (
                1 if rid in scheduler_output.sampling_request_ids else 0
            ), f"{request}: expected a token iff it samples, got {new_token_ids}"
            # Cache before a possible free, so the finished request's blocks stay reusable.
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if not new_token_ids:
                continue
            request.output_token_ids.extend(new_token_ids)
            updated.append(request)
            if self._check_stop(request):
                any_finished = True
                self._release(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _check_stop(self, request: Request) -> bool:
        """Set a finished status if the last output token ends the request."""
        token = request.output_token_ids[-1]
        params = request.sampling_params
        # EOS / stop tokens are honoured only once min_tokens tokens precede them;
        # they are checked before the length so that a final EOS reports "stop".
        if request.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in params.all_stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        max_tokens = request.max_tokens
        if (
            max_tokens is not None and request.num_output_tokens >= max_tokens
        ) or request.num_tokens >= self.max_num_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # ------------------------------------------------------------------ queries

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes."""
        self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """Current counts and cumulative counters."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )
