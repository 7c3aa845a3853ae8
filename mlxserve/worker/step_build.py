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
from mlxserve.models.contract import PipelineStageModel
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
    """The graph of (part of) a step: whom it samples for and its lazy results."""

    samplers: list[Request]
    result: SamplerOutput | None
    plp_targets: list[tuple[Request, int]]  # (request, position of the scored prompt token)
    prompt_logprobs: tuple[mx.array, ...] | None
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


def build_part(
    so: SchedulerOutput,
    *,
    model,
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
    # The scheduler orders decodes (one token each) first, as the attention op wants.
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens, context_lens = [], []
    tables: list[tuple[list[int], ...]] = []
    sample_rows: list[int] = []
    samplers: list[Request] = []
    drafts: list[list[int]] = []
    aheads: list[int] = []
    gather_rows: list[int] = []  # rows fed a token of the previous step, on the device
    gather_from: list[int] = []  # its row in the previous step's sampled tokens
    plp_rows: list[int] = []  # rows whose logits score the next prompt token
    plp_targets: list[tuple[Request, int]] = []  # (request, position of that token)
    pooling = PoolingRows()  # embedding requests: hidden states, no logits
    proposal = None
    if drafter is not None and drafter.proposes(so):
        # The draft model's passes first: the drafts are this forward's inputs.
        proposal = drafter.propose(so, lambda r, j: request_states.get(r).sampling.ahead(j))
    proposed_rows: list[int] = []  # rows of input_ids that take the proposal's drafts
    for req in so.scheduled_requests:
        rid = req.request_id
        n = so.num_scheduled_tokens[rid]
        start = so.start_positions[rid]
        end = start + n
        row0 = len(input_ids)
        tokens = so.token_ids(req)
        if tokens == [PLACEHOLDER_TOKEN]:
            assert previous is not None, f"{req}: its input token is neither known nor given"
            gather_rows.append(row0)
            gather_from.append(previous.rows[rid])
            tokens = [0]  # replaced below
        input_ids.extend(tokens)
        positions.extend(range(start, end))
        if req.pooling is not None:
            query_lens.append(n)
            context_lens.append(end)
            tables.append(so.block_ids[rid])
            pooling.add(req, row0, start, n, so.samples(rid))
            continue
        if rid in so.draft_token_ids:
            if proposal is not None:
                proposed_rows += range(row0 + 1, row0 + n)
            # Each verified position attends as a decode of its own (context up to
            # it): the decode path, which is much cheaper than a short causal chunk.
            query_lens += [1] * n
            context_lens += range(start + 1, end + 1)
            tables += [so.block_ids[rid]] * n
        else:
            query_lens.append(n)
            context_lens.append(end)
            tables.append(so.block_ids[rid])
        state = request_states.get(req)
        if req.sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_done:
            if start == 0:
                state.prompt_logprobs = [None]
            for pos in range(start, min(end, req.num_prompt_tokens - 1)):
                plp_rows.append(row0 + pos - start)
                plp_targets.append((req, pos + 1))
        if so.samples(rid):
            spec = so.draft_token_ids.get(rid, [])
            sample_rows.extend(range(row0 + n - 1 - len(spec), row0 + n))
            samplers.append(req)
            drafts.append(spec)
            # Outputs before this sample minus those its state holds: 1 while the previous
            # step's token is in flight (its noise key and min_tokens count it).
            num_before = start + n - len(spec) - req.num_prompt_tokens
            aheads.append(num_before - state.sampling.num_output_tokens)
    md, extra = step_metadata(
        layout, so, query_lens, context_lens, tables, block_size, takes_layout
    )
    rows = sample_rows + plp_rows + pooling.rows
    inputs = None
    assert not (for_ranks and gather_rows), "tensor parallel steps are never scheduled ahead"
    if for_ranks:
        # One full-attention group (the tensor-parallel models): one table per entry
        # of query_lens (a request with drafts has one per verified position).
        inputs = ForwardInputs(
            kv_cache.num_blocks,
            input_ids,
            query_lens,
            context_lens,
            [t[0] for t in tables],
            rows,
            len(pooling.rows),
        )
    ids = mx.array(input_ids, dtype=mx.int32)
    if proposal is not None:
        ids[mx.array(proposed_rows, dtype=mx.int32)] = proposal.token_ids
    if gather_rows:
        taken = previous.token_ids[mx.array(gather_from, dtype=mx.int32)]
        ids[mx.array(gather_rows, dtype=mx.int32)] = taken
    with nullcontext() if drafter is None else drafter.capture() as captured:
        out = model(
            ids,
            mx.array(positions, dtype=mx.int32),
            md,
            kv_cache,
            logits_indices=mx.array(rows, dtype=mx.int32) if rows else None,
            **extra,
            **({"num_hidden_rows": len(pooling.rows)} if pooling.rows else {}),
        )
    logits, hidden = out if pooling.rows else (out, None)
    pooled = None if hidden is None else pooling.reduce(hidden)
    result = None
    num_rows = len(sample_rows)
    sample_logits = logits[:num_rows] if samplers else None
    part = StepPart(samplers, None, plp_targets, None, sample_logits, drafts, aheads=aheads)
    part.poolers, part.pooled, part.proposal = pooling.requests, pooled, proposal
    if isinstance(model, PipelineStageModel):
        part.pool_writes = model.pool_writes(md.query_lens)
    if samplers and not any(request_states[r.request_id].grammar for r in samplers):
        states, draft_ids, draft_probs = sample_row_inputs(part, request_states)
        batch = make_sampling_batch(states, logits.shape[-1])
        result = sample(sample_logits, batch, draft_ids, draft_probs)
    plp = None
    if plp_rows:
        plp = prompt_logprobs(
            logits[num_rows:],
            [r.prompt_token_ids[pos] for r, pos in plp_targets],
            max(r.sampling_params.prompt_logprobs for r, _ in plp_targets),
        )
    part.result, part.prompt_logprobs, part.inputs = result, plp, inputs
    if captured is not None:  # MTP: after the sampler (a grammar's: sample_masked)
        part.follow = partial(drafter.follow, so, ids, captured, md)
        if result is not None or not samplers:
            part.followed = part.follow(result)
    return part


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
