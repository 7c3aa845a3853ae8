"""Speculative decoding on the scheduler's side: who proposes drafts, how many, back-off.

Each step, a decoding request may carry k drafts (``Request.spec_token_ids``); the
scheduler feeds them with its last token, the runner verifies them in the same forward
pass (worker/sampler.py, rejection sampling) and update_from_output keeps the accepted
prefix plus one token of the target model. Today's proposer is the n-gram one
(core/ngram_proposer.py, host-only); a draft model or MTP heads would fill
``spec_token_ids`` from the runner's output instead, and the rest stays as it is.

Requests that cannot be verified exactly yet do not speculate (and produce what they
would without speculation): penalties (their token counts would change inside a step),
structured outputs (drafts are not checked against the grammar), logprobs.

Back-off, so speculation does not cost more than it saves:
- by batch: with more than ``disable_by_batch_size`` running requests nothing is
  proposed (a big batch already keeps the device busy; drafts only add compute);
- by request: each verification updates a moving average of the fraction of drafts
  accepted (half old, half new); below ``min_acceptance_rate`` the request proposes
  nothing for its next ``PAUSE_TOKENS`` tokens, then tries again from a fresh average.
"""

from __future__ import annotations

from mlxserve.config import SpeculativeConfig
from mlxserve.core.ngram_proposer import NgramProposer
from mlxserve.core.request import Request

PAUSE_TOKENS = 16  # output tokens a request with poor acceptance goes without drafts


def can_speculate(request: Request) -> bool:
    """False for requests whose verification this engine cannot make exact yet."""
    p = request.sampling_params
    return (
        request.pooling is None  # an embedding request: prefill only
        and request.structured_output is None
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


class SpecDecoder:
    """Proposes drafts for decoding requests and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0  # verifications (a request's drafts in one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def is_on(self, num_running: int) -> bool:
        """Whether this step speculates at all (the batch-size back-off)."""
        return num_running <= self.config.disable_by_batch_size

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
        request.spec_token_ids = self.proposer.propose(request.all_token_ids, k)
        return request.spec_token_ids

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
