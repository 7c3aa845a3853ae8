"""What the scheduler hands the runner each step, what comes back, and the stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxserve.core.kv_cache_manager import StateSlots
from mlxserve.core.request import Request

# A draft token the runner's draft model proposes in this step (speculative_config.model):
# the scheduler knows how many drafts a request verifies, not what they are.
DRAFTER_TOKEN = -1
# The input of a decode scheduled before its previous step's token reached the host (async
# scheduling): the runner takes it on the device from that step's sampled tokens.
PLACEHOLDER_TOKEN = -2


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

    Speculative decoding: a request with ``draft_token_ids`` is fed its last token and its
    k drafts (n = 1 + k, positions past its known tokens) and samples at every one of those
    positions; the runner returns the drafts it accepted (a prefix) plus one token of the
    target model, 1 to k + 1 tokens::

        fed:      t  d0 d1 d2        logits at each: verify d0, d1, d2, then a bonus token
        accepted: d0 d1 | x          d2 rejected: x sampled in its place, K/V of d2 dropped

    With a draft model the drafts are ``DRAFTER_TOKEN`` here: the runner's drafter proposes
    them in the same step, after feeding the draft model the request's known tokens
    ``drafter_feeds[rid] = (start, end)`` (its catch-up: the prompt chunk the target
    computes, the tokens accepted last step, or what it missed while not speculating).

    Async scheduling: a request in ``placeholder_request_ids`` is a decode scheduled before
    the step that samples its input token was collected; ``token_ids`` gives
    ``[PLACEHOLDER_TOKEN]`` until that token is on the host.
    """

    # Batch order: the first num_decodes requests are decodes (one token, prompt done),
    # then decodes with drafts, then prefill chunks (and prompt/recompute chunks).
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
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # speculative decoding
    drafter_feeds: dict[str, tuple[int, int]] = field(default_factory=dict)  # draft model
    placeholder_request_ids: set[str] = field(default_factory=set)  # async scheduling
    # Prefix blocks found in the store (the disk tier): (block id, its K/V), written into
    # the pool before the step; their tokens count as computed.
    kv_loads: list[tuple[int, object]] = field(default_factory=list)

    def token_ids(self, request: Request) -> list[int]:
        """The tokens the runner feeds for request this step (its drafts last)."""
        rid = request.request_id
        start = self.start_positions[rid]
        drafts = self.draft_token_ids.get(rid)
        if drafts:
            return request.get_token_ids(start, request.num_tokens) + drafts
        if rid in self.placeholder_request_ids and start >= request.num_tokens:
            return [PLACEHOLDER_TOKEN]
        return request.get_token_ids(start, start + self.num_scheduled_tokens[rid])

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
            draft_token_ids={rid: d for rid, d in self.draft_token_ids.items() if rid in ids},
            drafter_feeds={rid: f for rid, f in self.drafter_feeds.items() if rid in ids},
            placeholder_request_ids=self.placeholder_request_ids & ids,
        )


@dataclass
class ModelRunnerOutput:
    """What the runner returns for one SchedulerOutput."""

    # request_id -> [new token] ([accepted drafts..., new token] with drafts); [] (or
    # absent) for a partial prefill chunk.
    sampled_token_ids: dict[str, list[int]]
    # request_id -> one logprobs entry per sampled token; opaque here, for the engine.
    logprobs: dict[str, list[object]] | None = None
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
    # Speculative decoding (vLLM's spec_decode counters): verifications of a request's
    # drafts, drafted tokens, and how many of them were accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Whether the last step could propose drafts (the batch-size and cost back-offs), and
    # how often the cost back-off has switched speculation on or off (core/spec_cost.py).
    spec_decode_enabled: bool = False
    spec_decode_cost_switches: int = 0
