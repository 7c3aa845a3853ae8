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

Speculative decoding (core/spec_decode.py): a decode may carry k drafts and compute
1 + k tokens. The drafts come out of the prefill share of the budget, never take a request
past max_tokens or max_model_len, and are dropped (a plain decode) when their blocks do
not fit. After the step ``num_computed_tokens`` moves back past the rejected drafts and
the blocks only they used are freed; prefix-cache hashes only ever cover verified tokens::

    before: computed T-1, tokens T     scheduled: t(T-1) d0 d1 d2   computed T+3
    after:  d0 d1 accepted + x         tokens T+3, computed T+2 (x is fed next step)

With a draft model the drafts are placeholders the runner fills in the same step, and
``SchedulerOutput.drafter_feeds`` says which known tokens the draft model computes first
(its catch-up, bounded per step: core/spec_decode.py).

Async scheduling (the engine's, as vLLM's ``--async-scheduling``): step N+1 may be
scheduled before step N's output is back, i.e. ``schedule()`` twice, then
``update_from_output(N)``, ``schedule()``, ``update_from_output(N+1)``... A request that
samples in N is then scheduled in N+1 with an *output placeholder*: its input is the token
N samples, which the runner takes on the device from N's sampled tokens::

    known tokens T, computed T-1   schedule N:   feed t(T-1), sample x   placeholders 1
                                   schedule N+1: feed x (position T)     placeholders 2
                                   update N:     x appended, known T+1   placeholders 1

``num_output_placeholders`` counts those tokens: the tokens left to compute, the sampling
row and the limits count them (no step past max_tokens or max_model_len is scheduled for a
request whose token in flight is its last). At most one token is in flight before a step:
the engine keeps one step ahead. What is not yet known is never hashed: ``cache_blocks``
covers only tokens fed in steps whose output has been seen (``num_uncollected_tokens``).
A request preempted while its token is in flight keeps that token (it is valid: its K/V
was computed before the blocks were freed) and is not readmitted before it arrives. A
request that ends at N (EOS, stop string, abort) may still be computed in N+1: that extra
token is discarded (the runner and update_from_output skip finished requests), and its
blocks, freed at N, are written by N+1 before any later step reads or writes them (every
step's pool write takes the previous step's pool arrays as inputs: stream order).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from mlxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from mlxserve.core.kv_cache_manager import KVCacheManager
from mlxserve.core.request import Request, RequestStatus
from mlxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from mlxserve.core.spec_decode import SpecDecoder
from mlxserve.exceptions import ParameterError

__all__ = ["ModelRunnerOutput", "Scheduler", "SchedulerOutput", "SchedulerStats"]


def needs_host_tokens(request: Request) -> bool:
    """Whether building this request's next step needs its previous token on the host, so a
    step holding it is never scheduled ahead (async scheduling): a sampling field that reads
    the output tokens (SamplingParams marks them: penalties, prompt logprobs), a grammar's
    bitmask that follows them, an embedding request that finishes with its last chunk."""
    return (
        request.sampling_params.needs_host_tokens()
        or request.structured_output is not None
        or request.pooling is not None
    )


def min_prefill_tokens(max_num_batched_tokens: int) -> int:
    """Prefill tokens a step offers however many decodes run: half the budget, rounded up."""
    return (max_num_batched_tokens + 1) // 2


class Scheduler:
    """Decides, each step, which requests compute how many tokens; tracks their lifecycle."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        speculative_config: SpeculativeConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: seconds, for speculation's cost back-off (None: no cost back-off)."""
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
        # Live requests for which no step may be scheduled ahead (needs_host_tokens).
        self.sync_request_ids: set[str] = set()
        # A recurrent state cannot roll back past rejected drafts: the engine turns it off.
        assert speculative_config is None or not cache_config.num_state_slots
        self.spec = None if speculative_config is None else SpecDecoder(speculative_config, clock)
        if self.spec is not None and speculative_config.method == "mtp":
            # An MTP layer's K/V at a block's last position depends on the next block's
            # first token: a hit's last block is recomputed (worker/mtp.py).
            self.kv_cache_manager.drop_last_hit_block = True

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
        if needs_host_tokens(request):
            self.sync_request_ids.add(request.request_id)

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
        self.sync_request_ids.discard(request.request_id)
        self.finished_request_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        # Recompute later from scratch: output tokens are kept, KV is dropped.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_drafter_tokens = 0  # the draft model's KV is dropped with the blocks
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocate their blocks."""
        budget = self.scheduler_config.max_num_batched_tokens
        num_decodes = sum(1 for r in self.running if self._num_left(r) == 1)
        # Decodes take one token each; prefill chunks get the rest, at least half the budget.
        prefill_budget = max(budget - num_decodes, min_prefill_tokens(budget))
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        preempted: list[str] = []
        loads: list[tuple[int, object]] = []  # (block id, K/V from the store)
        speculate = self.spec is not None and self._begin_spec_step(budget)

        # 1. Running requests, oldest first: a decode token or the next prompt chunk.
        index = 0
        while index < len(self.running):
            request = self.running[index]
            index += 1
            if request.num_output_placeholders and self._is_last_in_flight(request):
                continue  # its token in flight ends it: nothing past max_tokens / the length
            num_left = self._num_left(request)
            assert num_left >= 1, f"{request} has nothing to compute; missed update_from_output?"
            num_new = 1 if num_left == 1 else min(num_left, prefill_budget)
            if num_new == 0:
                continue  # prefill share spent; newer decodes still get their token
            if speculate and num_left == 1:
                spec = self._schedule_drafts(request, prefill_budget)
                if spec:
                    scheduled.append(request)
                    num_scheduled[request.request_id] = 1 + len(spec)
                    drafts[request.request_id] = spec
                    prefill_budget -= len(spec)
                    continue
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
            if request.num_output_placeholders:
                break  # preempted with its token in flight: readmitted once it is known
            kv = self.kv_cache_manager
            hit, num_hit_tokens = kv.get_computed_blocks(request)
            stored = kv.load_stored_blocks(request, num_hit_tokens)
            num_stored = len(stored) * kv.block_size
            num_new = min(request.num_tokens - num_hit_tokens - num_stored, prefill_budget)
            new_blocks = kv.allocate_slots(request, num_stored + num_new, hit, num_stored)
            if new_blocks is None:
                break  # the head does not fit; later ones wait behind it (FCFS)
            if stored:  # one full-attention group (the store is off otherwise)
                for block, kept in zip(new_blocks[0], stored, strict=False):
                    block.from_store = True
                    loads.append((block.block_id, kept))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens + num_stored
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens + num_stored
                request.num_stored_tokens = num_stored
            self.running.append(request)
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            prefill_budget -= num_new

        so = self._make_output(scheduled, num_scheduled, preempted, drafts)
        so.kv_loads = loads
        return so

    @staticmethod
    def _num_left(request: Request) -> int:
        """Tokens the request has to compute, its output placeholders included."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _is_last_in_flight(self, request: Request) -> bool:
        """Whether the request's token in flight is its last (max_tokens or the length)."""
        n = request.num_output_placeholders
        max_tokens = request.max_tokens
        return (
            max_tokens is not None and request.num_output_tokens + n >= max_tokens
        ) or request.num_tokens + n >= self.max_num_tokens

    def _begin_spec_step(self, budget: int) -> bool:
        assert self.spec is not None
        longest = max((r.num_tokens for r in self.running), default=0)
        return self.spec.begin_step(len(self.running), budget, longest)

    def _schedule_drafts(self, request: Request, budget: int) -> list[int]:
        """Propose drafts for a decoding request and allocate room for them; [] when there
        are none or they do not fit (the caller then schedules a plain decode)."""
        assert self.spec is not None
        room = min(budget, self.max_num_tokens - request.num_tokens - 1)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        spec = self.spec.propose(request, room)
        if spec and self.kv_cache_manager.allocate_slots(request, 1 + len(spec)) is None:
            request.spec_token_ids = spec = []
        return spec

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
        self,
        scheduled: list[Request],
        num_scheduled: dict[str, int],
        preempted: list[str],
        drafts: dict[str, list[int]],
    ) -> SchedulerOutput:
        start_positions: dict[str, int] = {}
        sampling: set[str] = set()
        decodes: list[Request] = []
        verifies: list[Request] = []  # decodes with drafts: the runner's decode rows too
        chunks: list[Request] = []
        placeholders: set[str] = set()
        for request in scheduled:
            rid = request.request_id
            start = start_positions[rid] = request.num_computed_tokens
            if request.num_output_placeholders:  # fed the token its previous step samples
                assert request.num_output_placeholders == 1 and rid not in drafts, request
                placeholders.add(rid)
            request.num_computed_tokens += num_scheduled[rid]
            request.num_uncollected_tokens += num_scheduled[rid]
            num_known = request.num_tokens + request.num_output_placeholders
            if request.num_computed_tokens == num_known + len(drafts.get(rid, ())):
                sampling.add(rid)
                request.num_output_placeholders += 1
            is_decode = num_scheduled[rid] == 1 and start >= request.num_prompt_tokens
            (decodes if is_decode else verifies if rid in drafts else chunks).append(request)
        finished, self.finished_request_ids = self.finished_request_ids, []
        kv = self.kv_cache_manager
        state_slots = {}
        if kv.state_pool is not None:
            state_slots = {r.request_id: kv.get_state_slots(r) for r in scheduled}
        feeds: dict[str, tuple[int, int]] = {}
        if self.spec is not None and self.spec.uses_drafter:
            for request in scheduled:
                rid = request.request_id
                num_drafts = len(drafts.get(rid, ()))
                start = start_positions[rid]
                feed = self.spec.drafter_feed(request, start, num_scheduled[rid], num_drafts)
                if feed is not None:
                    feeds[rid] = feed
        return SchedulerOutput(
            scheduled_requests=decodes + verifies + chunks,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_ids={r.request_id: kv.get_block_ids(r) for r in scheduled},
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            start_positions=start_positions,
            sampling_request_ids=sampling,
            num_decodes=len(decodes),
            state_slots=state_slots,
            draft_token_ids=drafts,
            drafter_feeds=feeds,
            placeholder_request_ids=placeholders,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append sampled tokens, apply stop rules, cache full blocks, free finished requests.

        Returns the requests that got a new token (finished ones included) this step.
        """
        updated: list[Request] = []
        any_finished = False
        sampled = model_runner_output.sampled_token_ids
        for request in scheduler_output.scheduled_requests:
            rid = request.request_id
            request.num_uncollected_tokens -= scheduler_output.num_scheduled_tokens[rid]
            if rid in scheduler_output.sampling_request_ids:
                request.num_output_placeholders -= 1
            if request.is_finished:
                continue  # ended after schedule() (abort, stop); its blocks are already free
            if request.pooling is not None:  # prefill only: done once the vector is out
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                if rid in model_runner_output.pooled:
                    request.status = RequestStatus.FINISHED_STOPPED
                    updated.append(request)
                    any_finished = True
                    self._release(request)
                continue
            # Preempted while its token was in flight (async scheduling): no blocks left.
            is_preempted = request.status == RequestStatus.PREEMPTED
            new_token_ids = sampled.get(rid) or []
            drafts = scheduler_output.draft_token_ids.get(rid, ())
            if rid in scheduler_output.sampling_request_ids:
                assert 1 <= len(new_token_ids) <= 1 + len(drafts), (request, new_token_ids)
            else:
                assert not new_token_ids, f"{request}: a token without sampling: {new_token_ids}"
            if drafts:  # forget the K/V of the rejected drafts
                request.num_computed_tokens -= len(drafts) + 1 - len(new_token_ids)
            is_stopped = False
            for i, token in enumerate(new_token_ids):
                request.output_token_ids.append(token)
                if self._check_stop(request):
                    is_stopped = True
                    if i + 1 < len(new_token_ids):  # a stop among accepted drafts ends there
                        sampled[rid] = new_token_ids = new_token_ids[: i + 1]
                        request.num_computed_tokens = request.num_tokens - 1
                    break
            # The draft model's KV past the target's (rejected drafts) is not kept either.
            request.num_drafter_tokens = min(
                request.num_drafter_tokens, request.num_computed_tokens
            )
            if drafts:
                assert self.spec is not None
                self.spec.record(request, len(drafts), len(new_token_ids) - 1)
            # Cache before a possible free, so the finished request's blocks stay reusable;
            # only K/V of steps whose output is back (async scheduling: N+1 is in flight).
            if not is_preempted:
                num_known = request.num_computed_tokens - request.num_uncollected_tokens
                self.kv_cache_manager.cache_blocks(request, num_known)
            if not new_token_ids:
                continue
            updated.append(request)
            if is_stopped:
                any_finished = True
                if is_preempted:
                    self.waiting.remove(request)
                self._release(request)
            elif drafts:
                self.kv_cache_manager.free_excess_blocks(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if self.spec is not None:
            self.spec.end_step(scheduler_output, sum(len(t) for t in sampled.values()))
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
            spec_decode_num_drafts=self.spec.num_drafts if self.spec else 0,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens if self.spec else 0,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens if self.spec else 0,
            spec_decode_enabled=self.spec.is_on if self.spec else False,
            spec_decode_cost_switches=self.spec.cost.num_switches if self.spec else 0,
        )
