"""Building a step's graph: a SchedulerOutput in, one lazy forward and sampler out.

Batch layout on the flat token axis (decodes first, as AttentionMetadata wants)::

    input_ids:  | d0 | d1 | p0 p0 p0 p0 p0 | p1 p1 p1 | s0 x0 x1 |
    samples:      ^    ^                ^          ^    ^  ^  ^   (last row of each request
                                                                   whose chunk reaches its
                                                                   end; every row of s0)

A decode scheduled ahead (async scheduling: its input token is a placeholder, the token
the previous step samples) is fed that token on the device, gathered from the previous
step's lazily sampled token ids: nothing waits for the previous step here.

A request with speculative drafts (s0: its last token, then drafts x0 x1) samples at each
of its rows, and row i verifies draft i (worker/sampler.py); worker/step_results.py keeps
the accepted drafts and the token of the first row whose draft is rejected (or of the last
row). Rows that score prompt tokens (prompt logprobs) and embedding requests' rows
(worker/pooling.py) follow the sample rows in the logits the model computes.

Nothing here evaluates: the runner starts the evaluation (worker/model_runner.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx

from mlxserve.core.request import Request
from mlxserve.core.scheduler import SchedulerOutput
from mlxserve.core.scheduler_output import PLACEHOLDER_TOKEN
from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.models.base import KVCache
from mlxserve.models.contract import Model, PipelineStageModel
from mlxserve.structured_output.grammar import fill_bitmasks
from mlxserve.worker.drafter import Drafter, Proposal
from mlxserve.worker.kv_inputs import step_metadata
from mlxserve.worker.pooling import PoolingRows
from mlxserve.worker.request_states import RequestStates
from mlxserve.worker.sampler import (
    SamplerOutput,
    SamplingState,
    make_sampling_batch,
    prompt_logprobs,
    sample,
)
from mlxserve.worker.spmd import ForwardInputs


@dataclass
class StepPart:
    """The graph of (part of) a step: whom it samples for and its lazy results.

    Each feature fills its own fields (see :func:`build_part`); a new one adds fields and
    the function that fills them."""

    samplers: list[Request] = field(default_factory=list)
    result: SamplerOutput | None = None
    # (request, position of the scored prompt token) per prompt-logprobs row
    plp_targets: list[tuple[Request, int]] = field(default_factory=list)
    prompt_logprobs: tuple[mx.array, ...] | None = None
    # The samplers' logits (S, V) while their grammar bitmasks are being computed.
    logits: mx.array | None = None
    # Per sampler, its drafts (speculative decoding): it has 1 + len(drafts) sample rows.
    drafts: list[list[int]] = field(default_factory=list)
    # Embedding requests in this step: (request, chunk starts at 0, chunk ends the prompt),
    # and per request the sum (mean pooling) or the last row of its chunk's hidden states.
    poolers: list[tuple[Request, bool, bool]] = field(default_factory=list)
    pooled: mx.array | None = None  # (len(poolers), hidden) float32
    inputs: ForwardInputs | None = None  # tensor parallel: what the other ranks run
    proposal: Proposal | None = None  # a draft model's drafts (worker/drafter.py)
    # MTP (worker/mtp.py): its pass over the step's rows, given the sampler's result.
    follow: Callable[[SamplerOutput | None], list[mx.array]] | None = None
    followed: list[mx.array] = field(default_factory=list)  # its arrays to evaluate
    # Per sampler, how many of its tokens are in flight before this step's (async
    # scheduling: 1 when its input is the previous step's token, not yet in its state).
    aheads: list[int] = field(default_factory=list)
    # Writes of each KV pool in this graph: > 1 for pipeline micro-batches on rank 0,
    # whose later writes are in place only if the earlier ones' readers have finished.
    pool_writes: int = 1

    @property
    def waited(self) -> bool:
        """Whether reading this part waited for its forward pass (it has host results)."""
        return any(a is not None for a in (self.result, self.prompt_logprobs, self.pooled))

    def arrays(self) -> list[mx.array]:
        """The part's lazy results, to evaluate with the pool."""
        out = list(self.prompt_logprobs or ()) + self.followed
        if self.proposal is not None:
            out.append(self.proposal.token_ids)
        if self.pooled is not None:
            out.append(self.pooled)
        if self.result is None and self.logits is not None:
            out.append(self.logits)
        if self.result is not None:
            r = self.result
            out += [
                r.token_ids,
                *(a for a in (r.logprobs, r.top_ids, r.top_logprobs) if a is not None),
            ]
        return out


@dataclass
class PreviousTokens:
    """The previous step's sampled token ids (lazy, (S,) int32) and each sampler's row."""

    token_ids: mx.array
    rows: dict[str, int]


@dataclass
class StepRows:
    """A step's flat rows on the host, and which rows each feature reads.

    The scheduler orders decodes (one token each) first, as the attention op wants."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # attention: one entry per query (a request with drafts: one per verified position)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    tables: list[tuple[list[int], ...]] = field(default_factory=list)
    # rows fed a token of the previous step on the device, and its row in those tokens
    gather_rows: list[int] = field(default_factory=list)
    gather_from: list[int] = field(default_factory=list)
    proposed_rows: list[int] = field(default_factory=list)  # take a draft model's drafts
    # sampling
    sample_rows: list[int] = field(default_factory=list)
    samplers: list[Request] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    aheads: list[int] = field(default_factory=list)
    # prompt logprobs: rows whose logits score the next prompt token
    plp_rows: list[int] = field(default_factory=list)
    plp_targets: list[tuple[Request, int]] = field(default_factory=list)
    pooling: PoolingRows = field(default_factory=PoolingRows)  # hidden states, no logits

    @property
    def logits_rows(self) -> list[int]:
        """The rows the model computes logits (or pooled states) for, in this order."""
        return self.sample_rows + self.plp_rows + self.pooling.rows

    def add_tokens(
        self, so: SchedulerOutput, req: Request, previous: PreviousTokens | None
    ) -> None:
        """The request's input tokens and positions (a placeholder: gathered on the device)."""
        start, n = so.start_positions[req.request_id], so.num_scheduled_tokens[req.request_id]
        tokens = so.token_ids(req)
        if tokens == [PLACEHOLDER_TOKEN]:
            assert previous is not None, f"{req}: its input token is neither known nor given"
            self.gather_rows.append(len(self.input_ids))
            self.gather_from.append(previous.rows[req.request_id])
            tokens = [0]  # replaced on the device
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, start + n))

    def add_attention(self, so: SchedulerOutput, req: Request, row0: int, proposed: bool) -> None:
        rid = req.request_id
        start, n = so.start_positions[rid], so.num_scheduled_tokens[rid]
        if rid in so.draft_token_ids and req.pooling is None:
            if proposed:
                self.proposed_rows += range(row0 + 1, row0 + n)
            # Each verified position attends as a decode of its own (context up to
            # it): the decode path, which is much cheaper than a short causal chunk.
            self.query_lens += [1] * n
            self.context_lens += range(start + 1, start + n + 1)
            self.tables += [so.block_ids[rid]] * n
        else:
            self.query_lens.append(n)
            self.context_lens.append(start + n)
            self.tables.append(so.block_ids[rid])

    def add_prompt_logprobs(
        self, so: SchedulerOutput, req: Request, row0: int, states: RequestStates
    ) -> None:
        state = states.get(req)
        if req.sampling_params.prompt_logprobs is None or state.prompt_logprobs_done:
            return
        start, n = so.start_positions[req.request_id], so.num_scheduled_tokens[req.request_id]
        if start == 0:
            state.prompt_logprobs = [None]
        for pos in range(start, min(start + n, req.num_prompt_tokens - 1)):
            self.plp_rows.append(row0 + pos - start)
            self.plp_targets.append((req, pos + 1))

    def add_sampler(
        self, so: SchedulerOutput, req: Request, row0: int, states: RequestStates
    ) -> None:
        rid = req.request_id
        if not so.samples(rid):
            return
        start, n = so.start_positions[rid], so.num_scheduled_tokens[rid]
        spec = so.draft_token_ids.get(rid, [])
        self.sample_rows.extend(range(row0 + n - 1 - len(spec), row0 + n))
        self.samplers.append(req)
        self.drafts.append(spec)
        # Outputs before this sample minus those its state holds: 1 while the previous
        # step's token is in flight (its noise key and min_tokens count it).
        num_before = start + n - len(spec) - req.num_prompt_tokens
        self.aheads.append(num_before - states.get(req).sampling.num_output_tokens)

    def add_pooler(self, so: SchedulerOutput, req: Request, row0: int) -> None:
        rid = req.request_id
        start, n = so.start_positions[rid], so.num_scheduled_tokens[rid]
        self.pooling.add(req, row0, start, n, so.samples(rid))


def lay_out(
    so: SchedulerOutput,
    request_states: RequestStates,
    previous: PreviousTokens | None,
    proposed: bool,
) -> StepRows:
    """Every scheduled request's rows: its tokens, its attention, and what it reads out
    (an embedding, or samples and prompt logprobs)."""
    rows = StepRows()
    for req in so.scheduled_requests:
        row0 = len(rows.input_ids)
        rows.add_tokens(so, req, previous)
        rows.add_attention(so, req, row0, proposed)
        if req.pooling is not None:
            rows.add_pooler(so, req, row0)
            continue
        rows.add_prompt_logprobs(so, req, row0, request_states)
        rows.add_sampler(so, req, row0, request_states)
    return rows


def device_input_ids(
    rows: StepRows, proposal: Proposal | None, previous: PreviousTokens | None
) -> mx.array:
    """The step's input ids, with the draft model's drafts and the previous step's tokens
    put in on the device."""
    ids = mx.array(rows.input_ids, dtype=mx.int32)
    if proposal is not None:
        ids[mx.array(rows.proposed_rows, dtype=mx.int32)] = proposal.token_ids
    if rows.gather_rows:
        assert previous is not None
        taken = previous.token_ids[mx.array(rows.gather_from, dtype=mx.int32)]
        ids[mx.array(rows.gather_rows, dtype=mx.int32)] = taken
    return ids


def build_part(
    so: SchedulerOutput,
    *,
    model: Model,
    kv_cache: KVCache,
    layout: KVCacheLayout,
    block_size: int,
    takes_layout: bool,
    request_states: RequestStates,
    drafter: Drafter | None,
    for_ranks: bool,
    previous: PreviousTokens | None = None,
) -> StepPart:
    """The lazy graph of the step ``so``: flat inputs, the model's forward, the sampler
    (unless a sampler has a grammar: then its logits, for :func:`sample_masked`).

    ``for_ranks`` (tensor parallel): also note the forward's inputs for the other ranks.
    ``previous``: the previous step's sampled tokens, for the decodes scheduled ahead.
    """
    proposal = None
    if drafter is not None and drafter.proposes(so):
        # The draft model's passes first: the drafts are this forward's inputs.
        proposal = drafter.propose(so, lambda r, j: request_states.get(r).sampling.ahead(j))
    rows = lay_out(so, request_states, previous, proposal is not None)
    md, extra = step_metadata(
        layout, so, rows.query_lens, rows.context_lens, rows.tables, block_size, takes_layout
    )
    assert not (for_ranks and rows.gather_rows), "tensor parallel steps are never scheduled ahead"
    ids = device_input_ids(rows, proposal, previous)
    logits_rows = rows.logits_rows
    num_hidden = len(rows.pooling.rows)
    with nullcontext() if drafter is None else drafter.capture() as captured:
        out = model(
            ids,
            mx.array(rows.positions, dtype=mx.int32),
            md,
            kv_cache,
            logits_indices=mx.array(logits_rows, dtype=mx.int32) if logits_rows else None,
            **extra,
            **({"num_hidden_rows": num_hidden} if num_hidden else {}),
        )
    logits, hidden = out if num_hidden else (out, None)
    part = StepPart(
        samplers=rows.samplers,
        plp_targets=rows.plp_targets,
        logits=logits[: len(rows.sample_rows)] if rows.samplers else None,
        drafts=rows.drafts,
        aheads=rows.aheads,
        poolers=rows.pooling.requests,
        pooled=None if hidden is None else rows.pooling.reduce(hidden),
        proposal=proposal,
        pool_writes=model.pool_writes(md.query_lens)
        if isinstance(model, PipelineStageModel)
        else 1,
        inputs=forward_inputs(rows, kv_cache) if for_ranks else None,
    )
    part.result = sample_unmasked(part, request_states, logits.shape[-1])
    part.prompt_logprobs = score_prompt(rows, logits)
    if captured is not None:  # MTP: after the sampler (a grammar's: sample_masked)
        part.follow = partial(drafter.follow, so, ids, captured, md)
        if part.result is not None or not part.samplers:
            part.followed = part.follow(part.result)
    return part


def forward_inputs(rows: StepRows, kv_cache: KVCache) -> ForwardInputs:
    """What the other tensor-parallel ranks run. One full-attention group (the
    tensor-parallel models): one table per entry of query_lens."""
    return ForwardInputs(
        kv_cache.num_blocks,
        rows.input_ids,
        rows.query_lens,
        rows.context_lens,
        [t[0] for t in rows.tables],
        rows.logits_rows,
        len(rows.pooling.rows),
    )


def sample_unmasked(
    part: StepPart, request_states: RequestStates, vocab_size: int
) -> SamplerOutput | None:
    """The samplers' tokens, unless one has a grammar (then :func:`sample_masked` samples
    once its bitmask is ready)."""
    if not part.samplers or any(request_states[r.request_id].grammar for r in part.samplers):
        return None
    states, draft_ids, draft_probs = sample_row_inputs(part, request_states)
    batch = make_sampling_batch(states, vocab_size)
    return sample(part.logits, batch, draft_ids, draft_probs)


def score_prompt(rows: StepRows, logits: mx.array) -> tuple[mx.array, ...] | None:
    """The prompt logprobs of this step's prompt-logprobs rows (after the sample rows)."""
    if not rows.plp_rows:
        return None
    return prompt_logprobs(
        logits[len(rows.sample_rows) :],
        [r.prompt_token_ids[pos] for r, pos in rows.plp_targets],
        max(r.sampling_params.prompt_logprobs for r, _ in rows.plp_targets),
    )


def sample_row_inputs(
    part: StepPart, request_states: RequestStates
) -> tuple[list[SamplingState], mx.array | None, mx.array | None]:
    """The sampling state of each sample row (a draft's row: as many outputs later),
    each row's draft (-1: none), or None when the part has no drafts, and the draft
    model's q of each row's draft (None: deterministic drafts, or all greedy)."""
    states: list[SamplingState] = []
    draft_ids: list[int] = []
    rows: list[int] = []  # the rows with a draft
    for req, spec, ahead in zip(part.samplers, part.drafts, part.aheads, strict=True):
        state = request_states[req.request_id].sampling
        rows += range(len(states), len(states) + len(spec))
        states += [state.ahead(ahead + i) for i in range(len(spec) + 1)]
        draft_ids += [*spec, -1]
    if len(states) == len(part.samplers):
        return states, None, None
    if part.proposal is not None:  # a draft model's: on the device
        return states, *part.proposal.sample_rows(draft_ids, rows)
    return states, mx.array(draft_ids, dtype=mx.int32), None


def sample_masked(parts: list[StepPart], request_states: RequestStates) -> float:
    """Sample the parts that have grammar rows, with their token bitmasks (host work
    done while the launched forward pass computes); the seconds the bitmasks took."""
    seconds = 0.0
    for part in parts:
        assert part.logits is not None
        # A request with drafts has no grammar: its rows get no mask.
        grammars = [
            g
            for r, spec in zip(part.samplers, part.drafts, strict=True)
            for g in [request_states[r.request_id].grammar] + [None] * len(spec)
        ]
        t0 = time.perf_counter()
        bitmask = fill_bitmasks(grammars, part.logits.shape[-1])
        seconds += time.perf_counter() - t0
        states, draft_ids, draft_probs = sample_row_inputs(part, request_states)
        batch = make_sampling_batch(states, part.logits.shape[-1])
        batch.bitmask = mx.array(bitmask)
        part.result = sample(part.logits, batch, draft_ids, draft_probs)
        if part.follow is not None:
            part.followed = part.follow(part.result)
    return seconds
