"""Speculative decoding on the scheduler's side: who proposes drafts, how many, back-off.

Each step, a decoding request may carry k drafts (``Request.spec_token_ids``); the
scheduler feeds them with its last token, the runner verifies them in the same forward
pass (worker/sampler.py, rejection sampling) and update_from_output keeps the accepted
prefix plus one token of the target model. Proposers:

- ``ngram`` (core/ngram_proposer.py, host-only): the drafts are known when scheduling.
- ``mtp``: as ``draft_model`` (k ``DRAFTER_TOKEN`` slots), with nothing to catch up on:
  the runner's MTP layer follows every row the target computes (worker/mtp.py).
- ``draft_model``: the scheduler decides how many drafts a request verifies (k slots,
  ``DRAFTER_TOKEN`` each) and what the draft model must catch up on first; the runner's
  drafter (worker/drafter.py) proposes the k tokens in the same step, on the device.

The draft model keeps its own KV in a second pool indexed by the target's block tables,
so blocks, preemption and freeing apply to it as they are. ``Request.num_drafter_tokens``
counts the positions of that KV that are valid for the request; it only ever reads those:

    target computed: 0 ............................. T-1 | t d0 d1 d2     (verify)
    drafter valid:   0 .................. D              | feeds [D, T) = ...t, then d0 d1
    after: a drafts accepted -> drafter valid min(T + 2, T + a) (its d2 was never fed)

It catches up on what it has not computed yet (a prompt chunk the target computes, the
tokens accepted last step, what it missed while paused or preempted, a prefix-cache hit:
cached blocks hold the target's KV, and the draft's only if this request wrote it), at
most ``max_num_batched_tokens`` tokens of catch-up per step over all requests; a request
that is behind by more than its share does not speculate this step.

Requests that cannot be verified exactly yet do not speculate (and produce what they
would without speculation): penalties (their token counts would change inside a step),
structured outputs (drafts are not checked against the grammar). Logprobs are those of
each accepted token's row, as without speculation.

Back-off, so speculation does not cost more than it saves:
- by batch: with more than ``disable_by_batch_size`` running requests nothing is
  proposed (a big batch already keeps the device busy; drafts only add compute);
- by request: each verification updates a moving average of the fraction of drafts
  accepted (half old, half new); below ``min_acceptance_rate`` the request proposes
  nothing for its next ``PAUSE_TOKENS`` tokens, then tries again from a fresh average;
- by cost (``disable_by_cost``, core/spec_cost.py): the wall time per emitted token of
  steps with and without drafts, per batch size; nothing is proposed while drafts cost
  more per token, with a few probe steps now and then to notice when that changes.
  The clock is the scheduler's caller's (``clock``; None: no cost back-off). A step in
  which the draft model catches up on more than k + 1 tokens of a request is not
  measured: that is what it missed while not speculating (plain steps, a pause, a
  prefix hit), the price of switching modes rather than of drafting (a step that drafts
  feeds it at most 2: the last token and a draft it accepted).
"""

from __future__ import annotations

from collections.abc import Callable

from mlxserve.config import SpeculativeConfig
from mlxserve.core.ngram_proposer import NgramProposer
from mlxserve.core.request import Request
from mlxserve.core.scheduler_output import DRAFTER_TOKEN, SchedulerOutput
from mlxserve.core.spec_cost import CostBackoff

PAUSE_TOKENS = 16  # output tokens a request with poor acceptance goes without drafts


def can_speculate(request: Request) -> bool:
    """False for requests whose verification this engine cannot make exact yet."""
    p = request.sampling_params
    return (
        request.pooling is None  # an embedding request: prefill only
        and request.structured_output is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


class SpecDecoder:
    """Proposes drafts for decoding requests and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        # The cost back-off measures steps with this clock (None: acceptance and batch only).
        self.clock = clock if config.disable_by_cost else None
        self.cost = CostBackoff()
        self._step_start: float | None = None  # clock() when the step in flight was scheduled
        self._step_batch = self._step_context = 0
        self.uses_drafter = config.method == "draft_model"
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0  # verifications (a request's drafts in one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.is_on = False  # this step speculates (begin_step)
        self.catchup_left = 0  # draft model: catch-up tokens left in this step
        self._step_catchup = 0  # draft model: the most known tokens fed to a request this step

    def begin_step(self, num_running: int, budget: int, context_len: int = 0) -> bool:
        """Start a step; whether it speculates at all (the batch-size and cost back-offs).
        ``context_len``: the longest running request's tokens."""
        self.is_on = num_running <= self.config.disable_by_batch_size
        if self.is_on and self.clock is not None:
            self.is_on = self.cost.should_speculate(num_running, context_len)
        self.catchup_left, self._step_catchup = budget, 0
        self._step_batch, self._step_context = num_running, context_len
        self._step_start = None if self.clock is None else self.clock()
        return self.is_on

    def end_step(self, so: SchedulerOutput, num_tokens: int) -> None:
        """The step scheduled last has been updated: it emitted ``num_tokens`` tokens.
        Decode-only steps (plain or verifying) feed the cost back-off."""
        if self._step_start is None or self.clock is None:
            return
        seconds, self._step_start = self.clock() - self._step_start, None
        num_requests = len(so.scheduled_requests)
        is_decode_only = (
            num_requests > 0
            and so.num_decodes + len(so.draft_token_ids) == num_requests
            and not so.preempted_request_ids
            and num_requests == self._step_batch
        )
        # A long catch-up is the price of the plain steps before it, not of drafting.
        is_catching_up = self._step_catchup > self.config.num_speculative_tokens + 1
        if (
            is_decode_only
            and not is_catching_up
            and self._step_batch <= self.config.disable_by_batch_size
        ):
            speculated = bool(so.draft_token_ids)
            self.cost.observe(self._step_batch, speculated, seconds, num_tokens, self._step_context)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Drafts for a request about to decode (at most ``max_drafts``, which the caller
        has bounded by the budget, max_tokens and max_model_len); also kept in
        ``request.spec_token_ids``."""
        request.spec_token_ids = []
        k = min(self.config.num_speculative_tokens, max_drafts)
        if k < 1 or request.num_output_tokens < request.spec_paused_until:
            return []
        if not can_speculate(request):
            return []
        if self.uses_drafter:
            # The draft model must first compute every known token but t (fed with t).
            lag = request.num_computed_tokens - request.num_drafter_tokens
            if lag > self.catchup_left:
                return []
            self.catchup_left -= lag
            request.spec_token_ids = [DRAFTER_TOKEN] * k
        elif self.config.method == "mtp":
            # The runner's MTP layer is always caught up (worker/mtp.py): nothing to feed.
            request.spec_token_ids = [DRAFTER_TOKEN] * k
        else:
            request.spec_token_ids = self.proposer.propose(request.all_token_ids, k)
        return request.spec_token_ids

    def drafter_feed(
        self, request: Request, start: int, num_new: int, num_drafts: int
    ) -> tuple[int, int] | None:
        """The known tokens [start, end) the draft model computes for a scheduled request
        this step (None: nothing); moves ``num_drafter_tokens`` past them and the drafts
        it feeds itself. The target computes ``num_new`` tokens from ``start``, the last
        ``num_drafts`` of them drafts."""
        assert self.uses_drafter
        if not self.is_on or not can_speculate(request):
            return None
        if request.num_output_tokens < request.spec_paused_until:
            return None  # paused: catch up when it proposes again
        begin = request.num_drafter_tokens
        end = start + num_new - num_drafts  # the known tokens the target has after it
        if not num_drafts:  # a request with drafts reserved its catch-up in propose()
            lag = start - begin
            if lag > self.catchup_left:
                end = begin + self.catchup_left  # part of it; drafts once caught up
            self.catchup_left -= min(lag, self.catchup_left)
            if end <= begin:
                return None
        self._step_catchup = max(self._step_catchup, end - begin)
        # It feeds its drafts but the last (that one's K/V is computed next step if kept).
        request.num_drafter_tokens = end + max(num_drafts - 1, 0)
        return begin, end

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count one verification (after its tokens are appended); per-request back-off."""
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        request.spec_acceptance = 0.5 * request.spec_acceptance + 0.5 * num_accepted / num_drafts
        if request.spec_acceptance < self.config.min_acceptance_rate:
            request.spec_paused_until = request.num_output_tokens + PAUSE_TOKENS
            request.spec_acceptance = 1.0
