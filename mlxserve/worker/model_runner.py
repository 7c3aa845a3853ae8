"""ModelRunner: everything on the device -- the model, the KV block pool, every evaluation.

    LLMEngine (requests, scheduling, outputs)     ModelRunner (one per device / rank)
      plan_kv_cache(...) -> KVPlan           ->   probe activation memory, size the pool
      ensure_blocks(n, slots)                ->   create / grow the K/V (and state) arrays
      launch(SchedulerOutput) -> StepHandle  ->   flat arrays, model, sampler, mx.async_eval
      collect(StepHandle) -> ModelRunnerOutput -> wait; sampled tokens as host lists

The K/V arrays are created by ensure_blocks, i.e. on the thread that steps the engine:
MLX cannot evaluate a lazy array on a thread other than the one that made it.

Batch layout on the flat token axis (decodes first, as AttentionMetadata wants)::

    input_ids:  | d0 | d1 | p0 p0 p0 p0 p0 | p1 p1 p1 | s0 x0 x1 |
    samples:      ^    ^                ^          ^    ^  ^  ^   (last row of each request
                                                                   whose chunk reaches its
                                                                   end; every row of s0)

A request with speculative drafts (s0: its last token, then drafts x0 x1) samples at each
of its rows, and row i verifies draft i (worker/sampler.py); _read keeps the accepted
drafts and the token of the first row whose draft is rejected (or of the last row).

The pool follows the model's KVCacheLayout (mlxserve/kv_cache_spec.py): one K/V tensor per
layer, or per layer slot of its KV cache groups, each group with its own block tables
(one AttentionMetadata per group), and state slots for recurrent layers (StateMetadata).

A step that raises is not charged to the whole batch (worker/isolation.py): the runner
re-runs it for halves of its requests until the request(s) that fail alone are found;
those are reported in ``ModelRunnerOutput.failed`` and every other request gets the
token it would have got anyway.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import numpy as np

from mlxserve import ops
from mlxserve.core.request import Logprobs, Request
from mlxserve.core.scheduler import ModelRunnerOutput, SchedulerOutput
from mlxserve.kv_cache_spec import KVCacheLayout, uniform_layout
from mlxserve.models.base import KVCache
from mlxserve.models.fused import fuse_projections
from mlxserve.ops import AttentionMetadata
from mlxserve.ops.kv_quant import kv_pool_dtype
from mlxserve.structured_output.grammar import GrammarState, fill_bitmasks
from mlxserve.worker.drafter import Drafter, Proposal
from mlxserve.worker.isolation import KVCacheLostError, bisect, describe
from mlxserve.worker.kv_inputs import probe_arguments, step_metadata
from mlxserve.worker.memory import (
    PROBE_TOKENS,
    KVPlan,
    agree_on_plan,
    plan_kv_cache,
    probe_activation_bytes,
    tree_bytes,
)
from mlxserve.worker.pooling import PoolingRows, PoolingSums
from mlxserve.worker.sampler import (
    SamplerOutput,
    SamplingState,
    make_sampling_batch,
    prompt_logprobs,
    sample,
)
from mlxserve.worker.spmd import ForwardInputs, StepChannel

__all__ = ["KVCacheLostError", "ModelRunner", "StepHandle"]

logger = logging.getLogger("mlxserve")


@dataclass
class _RequestState:
    """What the runner keeps per live request between steps."""

    sampling: SamplingState
    grammar: GrammarState | None = None  # structured outputs: where the output is in it
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    # Set once the whole prompt is scored: a preempted request recomputes its prompt,
    # but its prompt logprobs are not computed (or reported) twice.
    prompt_logprobs_done: bool = False


@dataclass
class _Part:
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

    def arrays(self) -> list[mx.array]:
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
class _Read:
    """A part's results on the host, not yet applied to the request states."""

    samples: list[tuple[Request, list[int], list[Logprobs] | None]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Request, Logprobs]] = field(default_factory=list)
    pooled: list[tuple[Request, bool, bool, np.ndarray]] = field(default_factory=list)


@dataclass
class StepHandle:
    """A launched step: what to read back once its evaluation finishes."""

    scheduler_output: SchedulerOutput
    parts: list[_Part]
    failed: dict[str, str]  # requests that failed while the step was built
    error: str | None = None  # mx.async_eval itself raised


class ModelRunner:
    """Owns the model and the KV pool; turns scheduled requests into sampled tokens."""

    def __init__(
        self,
        model,
        *,
        dtype: mx.Dtype,
        block_size: int,
        kernels: str = "auto",
        seed: int = 0,
        channel: StepChannel | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        fuse_projections(model)  # one matmul for q/k/v, one for gate/up (after sharding)
        # Tensor parallel (rank 0): every forward's inputs go to the other ranks first.
        self.channel = channel
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size: int = model.vocab_size
        self.kernels = kernels  # "auto" | "metal" | "fallback", checked at start-up
        # Adapted mlx-lm models say what each layer needs; hand-written ones are uniform.
        self.layout: KVCacheLayout = getattr(model, "kv_cache_layout", None) or uniform_layout(
            model.num_layers, model.num_kv_heads, model.head_dim
        )
        self._takes_layout = hasattr(model, "kv_cache_layout")
        dims = [d for _, k, v in self.layout.tensor_shapes for d in (k, v)]
        self.kv_dtype = kv_pool_dtype(kv_cache_dtype, dtype, dims)  # int8: 8-bit (kv_quant)
        self.kv_cache: KVCache | None = None  # made by the first ensure_blocks()
        # Speculative decoding with a draft model: set by the engine before planning.
        self.drafter: Drafter | None = None
        mx.random.seed(seed)
        self._rng = random.Random(seed)
        self._states: dict[str, _RequestState] = {}
        # Mean pooling over a prompt computed in chunks: the running sum of hidden states.
        self._pool_sums = PoolingSums()
        # Host time spent on grammar bitmasks, and in how many steps (bench/ reads them).
        self.num_mask_steps = 0
        self.mask_seconds = 0.0

    # ------------------------------------------------------------- the pool
    @property
    def num_blocks(self) -> int:
        """Blocks the K/V arrays hold now (0 before the first ensure_blocks)."""
        return 0 if self.kv_cache is None else self.kv_cache.num_blocks

    def plan_kv_cache(
        self,
        *,
        max_num_batched_tokens: int,
        max_model_len: int | None,
        max_num_seqs: int,
        memory_fraction: float,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> KVPlan:
        """Size the pool (worker/memory.py), probing a forward pass's activation peak."""
        m = self.model
        activation = 0
        if num_blocks is None and kv_cache_memory_bytes is None:
            n = min(PROBE_TOKENS, max_num_batched_tokens)
            with ops.use_kernels(self.kernels):
                per_token = probe_activation_bytes(
                    m, self._allocate, self._probe_args, self.block_size, n
                )
                if self.drafter is not None:
                    per_token += self.drafter.probe_activation_bytes(max_num_batched_tokens)
            activation = int(per_token * max_num_batched_tokens)
        layout, weights = self.layout, tree_bytes(m.parameters())
        if self.drafter is not None:  # its pool has the same blocks: each costs both
            layout = self.drafter.planning_layout(layout)
            weights += self.drafter.weights_bytes
        plan = plan_kv_cache(
            layout=layout,
            dtype=self.kv_dtype,
            block_size=self.block_size,
            model_max_len=m.max_position_embeddings or max_model_len or 4096,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            memory_fraction=memory_fraction,
            weights_bytes=weights,
            activation_bytes=activation,
            num_blocks=num_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
        )
        return plan if self.group is None else agree_on_plan(plan, self.group)

    @property
    def group(self) -> mx.distributed.Group | None:
        """The group this runner's model is split over, tensor or pipeline (None: alone)."""
        return getattr(self.model, "tp_group", None) or getattr(self.model, "pp_group", None)

    def _check_lost(self, error: BaseException) -> None:
        """Re-raise a step's error as RankLostError when a tensor-parallel rank is gone:
        no per-request isolation then (every forward needs every rank)."""
        if self.channel is not None:
            self.channel.check(error)

    def _probe_args(self, md: AttentionMetadata) -> dict[str, object]:
        return probe_arguments(self.layout, md) if self._takes_layout else {}

    def ensure_blocks(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """Make the K/V arrays hold at least ``num_blocks`` blocks and the state arrays
        ``num_state_slots`` slots (new ones zeroed).

        Call it on the thread that steps: the arrays (or their growth) are lazy until the
        next launch evaluates them.
        """
        if self.kv_cache is None:
            self.kv_cache = self._allocate(num_blocks, num_state_slots)
        else:
            self.kv_cache.ensure_num_blocks(num_blocks)
            self.kv_cache.ensure_num_state_slots(num_state_slots)
        if self.drafter is not None:
            self.drafter.ensure_blocks(num_blocks)

    def _allocate(self, num_blocks: int, num_state_slots: int = 2) -> KVCache:
        slots = num_state_slots if self.layout.has_state else 0
        return KVCache.allocate_layout(
            self.layout, num_blocks, self.block_size, self.kv_dtype, slots
        )

    def _pool(self) -> tuple:
        assert self.kv_cache is not None, "ensure_blocks() comes before the first launch()"
        kv = self.kv_cache
        drafter = None if self.drafter is None else self.drafter.save()
        return list(kv.keys), list(kv.values), [list(arrays) for arrays in kv.states], drafter

    def _restore(self, pool: tuple) -> None:
        """Put back the pool arrays of before a failed build (drops its lazy writes)."""
        assert self.kv_cache is not None
        keys, values, states, drafter = pool
        self.kv_cache.keys[:], self.kv_cache.values[:] = keys, values
        for arrays, saved in zip(self.kv_cache.states, states, strict=True):
            arrays[:] = saved
        if drafter is not None:
            self.drafter.restore(drafter)

    def _pool_arrays(self) -> list[mx.array]:
        """Every pool array the step writes: the target's, and the draft model's."""
        assert self.kv_cache is not None
        drafter = [] if self.drafter is None else self.drafter.arrays()
        return self.kv_cache.arrays() + drafter

    def _settle_pool(self) -> None:
        """Evaluate the pool after a failed step; if even that fails, its contents are lost."""
        assert self.kv_cache is not None
        try:
            mx.eval(self._pool_arrays())
        except Exception as e:  # noqa: BLE001 -- the engine must drop every request
            self._check_lost(e)
            self.kv_cache = None  # the next ensure_blocks() makes a fresh, zeroed pool
            if self.drafter is not None:
                self.drafter.drop()
            self._states.clear()
            raise KVCacheLostError(
                f"the KV cache could not be evaluated after a failed step: {describe(e)}"
            ) from None

    # ------------------------------------------------------------------ steps
    def run_forward(self, inputs: ForwardInputs) -> None:
        """Tensor-parallel rank r > 0: run rank 0's forward on this shard.

        Every rank must evaluate the same collectives: rank 0 evaluates the logits when
        it needs rows of them (and only then does the last layer's output, with its
        all_sums, get computed), so this rank evaluates them exactly then too.
        """
        self.ensure_blocks(inputs.num_blocks)
        rows = inputs.logits_rows
        with ops.use_kernels(self.kernels):
            logits = self.model(
                mx.array(inputs.input_ids, dtype=mx.int32),
                mx.array(inputs.positions(), dtype=mx.int32),
                inputs.metadata(self.block_size),
                self.kv_cache,
                logits_indices=mx.array(rows, dtype=mx.int32) if rows else None,
            )
        mx.eval(self.kv_cache.arrays(), *([logits] if rows else []))

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            params = request.sampling_params
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            stop_ids = frozenset(request.eos_token_ids) | params.all_stop_token_ids
            sampling = SamplingState(params, seed, request.prompt_token_ids, stop_ids=stop_ids)
            so = request.structured_output
            grammar = None if so is None else so.new_state(stop_ids)
            for tok in request.output_token_ids:  # a request resumes (its state was lost)
                sampling.append(tok)
                if grammar is not None:
                    grammar.accept(tok)
            state = _RequestState(sampling, grammar)
            self._states[request.request_id] = state
        return state

    def launch(self, so: SchedulerOutput) -> StepHandle:
        """Build the step's graph and start evaluating it; returns at once.

        The caller may do host work that does not need this step's results (the engine
        processes the previous step's outputs) before :meth:`collect`. Requests whose
        part of the graph cannot be built are left out and reported by collect().
        """
        for rid in so.finished_request_ids:
            self._states.pop(rid, None)
            self._pool_sums.drop(rid)
        handle = StepHandle(so, [], {})
        if not so.scheduled_requests:
            return handle
        handle.parts = self._build_isolating(so, handle.failed)
        outs = self._pool_arrays()
        for part in handle.parts:
            outs += part.arrays()
        try:
            mx.async_eval(*outs)  # the forward pass (and sampling, without grammars)
            masked = [part for part in handle.parts if part.result is None and part.samplers]
            if masked:
                # Grammar bitmasks on the host while the forward pass computes, then
                # the sampler of those parts on top of it.
                self._sample_masked(masked)
                mx.async_eval(*(a for part in masked for a in part.arrays()))
        except Exception as e:  # noqa: BLE001 -- collect() finds whose fault it was
            self._check_lost(e)
            handle.error = describe(e)
        return handle

    @staticmethod
    def release_thread() -> None:
        """Free the MLX streams of the calling thread; call it last in a thread that stepped.

        MLX leaves that cleanup to each thread (the main thread's runs at exit): skipped, a
        process that stepped on another thread aborted in its C++ teardown in 3 of 12 exits here.
        """
        mx.clear_streams()

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step; its sampled tokens (and logprobs) as host lists.

        If the step failed, it is re-run for halves of its requests; the requests that
        fail alone end up in ``failed`` (KVCacheLostError if the pool itself is lost).
        """
        output = ModelRunnerOutput({}, {}, {}, failed=dict(handle.failed))
        error = handle.error
        if error is None:
            try:
                reads = [self._read(part) for part in handle.parts]
            except Exception as e:  # noqa: BLE001 -- isolated below
                self._check_lost(e)
                error = describe(e)
            else:
                for read in reads:
                    self._commit(read, output)
                return output
        so = handle.scheduler_output
        logger.warning(
            "a step of %d requests failed (%s); re-running it in parts to find the cause",
            len(so.scheduled_requests),
            error,
        )
        handle.parts = []  # drop the failed graph before re-running
        self._settle_pool()
        live = [r for r in so.scheduled_requests if r.request_id not in output.failed]
        bisect(so.subset(live), error, output.failed, lambda sub: self._rerun(sub, output))
        return output

    def _rerun(self, so: SchedulerOutput, output: ModelRunnerOutput) -> str | None:
        """Run part of a failed step to the end; its error, or None once committed."""
        pool = self._pool()  # held during the eval: no donation, so a failure can restore
        try:
            parts = self._build_isolating(so, output.failed)
            self._sample_masked([p for p in parts if p.result is None and p.samplers])
            mx.eval(self._pool_arrays(), [p.arrays() for p in parts])
            reads = [self._read(part) for part in parts]
        except Exception as e:  # noqa: BLE001 -- the caller splits this part further
            self._check_lost(e)
            self._restore(pool)
            return describe(e)
        for read in reads:
            self._commit(read, output)
        return None

    def _build_isolating(self, so: SchedulerOutput, failed: dict[str, str]) -> list[_Part]:
        """Build the step's graph; if that raises, build halves (recursively) instead.

        Building evaluates nothing, so the pool arrays from before a failed build are
        intact and put back. They are held only while building: evaluation must be able
        to update the pool in place.
        """
        parts: list[_Part] = []

        def build(sub: SchedulerOutput) -> str | None:
            pool = self._pool()
            try:
                with ops.use_kernels(self.kernels):
                    part = self._build(sub)
            except Exception as e:  # noqa: BLE001 -- split and try again
                self._check_lost(e)
                self._restore(pool)
                return describe(e)
            if self.channel is not None and part.inputs is not None:
                self._start_everywhere(part)
            parts.append(part)
            return None

        error = build(so)
        if error is not None:
            logger.warning(
                "building a step of %d requests failed (%s); building it in parts",
                len(so.scheduled_requests),
                error,
            )
            bisect(so, error, failed, build)
        return parts

    def _start_everywhere(self, part: _Part) -> None:
        """Tensor parallel: send a built part's forward to the other ranks and start it
        here, so its collectives are queued before the next message's, in the order
        every rank runs them."""
        assert self.channel is not None and part.inputs is not None
        self.channel.send(part.inputs)
        try:
            mx.async_eval(self.kv_cache.arrays(), part.arrays())
        except RuntimeError as e:
            raise self.channel.lost(e) from None

    def _build(self, so: SchedulerOutput) -> _Part:
        # The scheduler orders decodes (one token each) first, as the attention op wants.
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        tables: list[tuple[list[int], ...]] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        drafts: list[list[int]] = []
        plp_rows: list[int] = []  # rows whose logits score the next prompt token
        plp_targets: list[tuple[Request, int]] = []  # (request, position of that token)
        pooling = PoolingRows()  # embedding requests: hidden states, no logits
        proposal = None
        if self.drafter is not None and self.drafter.proposes(so):
            # The draft model's passes first: the drafts are this forward's inputs.
            proposal = self.drafter.propose(so, lambda r, j: self._state(r).sampling.ahead(j))
        proposed_rows: list[int] = []  # rows of input_ids that take the proposal's drafts
        for req in so.scheduled_requests:
            rid = req.request_id
            n = so.num_scheduled_tokens[rid]
            start = so.start_positions[rid]
            end = start + n
            row0 = len(input_ids)
            input_ids.extend(so.token_ids(req))
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
            state = self._state(req)
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
        md, extra = step_metadata(
            self.layout, so, query_lens, context_lens, tables, self.block_size, self._takes_layout
        )
        rows = sample_rows + plp_rows + pooling.rows
        inputs = None
        if self.channel is not None:
            # One full-attention group (the tensor-parallel models): one table per entry
            # of query_lens (a request with drafts has one per verified position).
            inputs = ForwardInputs(
                self.num_blocks,
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
        with nullcontext() if self.drafter is None else self.drafter.capture() as captured:
            out = self.model(
                ids,
                mx.array(positions, dtype=mx.int32),
                md,
                self.kv_cache,
                logits_indices=mx.array(rows, dtype=mx.int32) if rows else None,
                **extra,
                **({"num_hidden_rows": len(pooling.rows)} if pooling.rows else {}),
            )
        logits, hidden = out if pooling.rows else (out, None)
        pooled = None if hidden is None else pooling.reduce(hidden)
        result = None
        num_rows = len(sample_rows)
        sample_logits = logits[:num_rows] if samplers else None
        part = _Part(samplers, None, plp_targets, None, sample_logits, drafts)
        part.poolers, part.pooled, part.proposal = pooling.requests, pooled, proposal
        if samplers and not any(self._states[r.request_id].grammar for r in samplers):
            states, draft_ids, draft_probs = self._sample_rows(part)
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
        if captured is not None:  # MTP: after the sampler (a grammar's: _sample_masked)
            part.follow = partial(self.drafter.follow, so, ids, captured, md)
            if result is not None or not samplers:
                part.followed = part.follow(result)
        return part

    def _sample_rows(
        self, part: _Part
    ) -> tuple[list[SamplingState], mx.array | None, mx.array | None]:
        """The sampling state of each sample row (a draft's row: as many outputs later),
        each row's draft (-1: none), or None when the part has no drafts, and the draft
        model's q of each row's draft (None: deterministic drafts, or all greedy)."""
        states: list[SamplingState] = []
        draft_ids: list[int] = []
        rows: list[int] = []  # the rows with a draft
        for req, spec in zip(part.samplers, part.drafts, strict=True):
            state = self._states[req.request_id].sampling
            rows += range(len(states), len(states) + len(spec))
            states += [state.ahead(i) for i in range(len(spec) + 1)]
            draft_ids += [*spec, -1]
        if len(states) == len(part.samplers):
            return states, None, None
        if part.proposal is not None:  # a draft model's: on the device
            return states, *part.proposal.sample_rows(draft_ids, rows)
        return states, mx.array(draft_ids, dtype=mx.int32), None

    def _sample_masked(self, parts: list[_Part]) -> None:
        """Sample the parts that have grammar rows, with their token bitmasks (host work
        done while the launched forward pass computes)."""
        for part in parts:
            assert part.logits is not None
            # A request with drafts has no grammar: its rows get no mask.
            grammars = [
                g
                for r, spec in zip(part.samplers, part.drafts, strict=True)
                for g in [self._states[r.request_id].grammar] + [None] * len(spec)
            ]
            t0 = time.perf_counter()
            bitmask = fill_bitmasks(grammars, part.logits.shape[-1])
            self.mask_seconds += time.perf_counter() - t0
            states, draft_ids, draft_probs = self._sample_rows(part)
            batch = make_sampling_batch(states, part.logits.shape[-1])
            batch.bitmask = mx.array(bitmask)
            part.result = sample(part.logits, batch, draft_ids, draft_probs)
            if part.follow is not None:
                part.followed = part.follow(part.result)
        self.num_mask_steps += 1

    def _read(self, part: _Part) -> _Read:
        """Wait for a part and copy its results to the host (request states untouched)."""
        read = _Read()
        if part.result is not None:
            r = part.result
            token_ids = np.array(r.token_ids).tolist()
            chosen = np.array(r.logprobs).tolist() if r.logprobs is not None else None
            top_ids = np.array(r.top_ids).tolist() if r.top_ids is not None else None
            top_lp = np.array(r.top_logprobs).tolist() if r.top_logprobs is not None else None
            accepted = np.array(r.accepted).tolist() if r.accepted is not None else None
            specs = part.drafts if part.proposal is None else part.proposal.read(part.drafts)
            i = 0  # the request's first sample row
            for req, spec in zip(part.samplers, specs, strict=True):
                tokens = []
                for j, draft in enumerate(spec):
                    if not accepted[i + j]:
                        tokens.append(token_ids[i + j])
                        break
                    tokens.append(draft)
                else:
                    tokens.append(token_ids[i + len(spec)])
                entries: list[Logprobs] | None = None
                k = req.sampling_params.logprobs
                if k is not None and chosen is not None:
                    # Row i + j scored the j-th token (an accepted draft, then the last).
                    entries = []
                    for j, tok in enumerate(tokens):
                        entry = {tok: chosen[i + j]}
                        if k and top_ids is not None:
                            for t in range(k):
                                entry.setdefault(top_ids[i + j][t], top_lp[i + j][t])
                        entries.append(entry)
                read.samples.append((req, tokens, entries))
                i += len(spec) + 1
        if part.prompt_logprobs is not None:
            chosen = np.array(part.prompt_logprobs[0]).tolist()
            tops = [np.array(a).tolist() for a in part.prompt_logprobs[1:]]
            for i, (req, pos) in enumerate(part.plp_targets):
                entry = {req.prompt_token_ids[pos]: chosen[i]}
                for j in range(req.sampling_params.prompt_logprobs or 0):
                    entry.setdefault(tops[0][i][j], tops[1][i][j])
                read.prompt_logprobs.append((req, entry))
        if part.pooled is not None:
            rows = np.array(part.pooled, dtype=np.float64)
            for (req, first, done), row in zip(part.poolers, rows, strict=True):
                read.pooled.append((req, first, done, row))
        return read

    def _commit(self, read: _Read, output: ModelRunnerOutput) -> None:
        """Apply a part's results to the request states and the step's output."""
        for req, tokens, entries in read.samples:
            state = self._states[req.request_id]
            if state.grammar is not None:  # never with drafts: one token
                try:
                    state.grammar.accept(tokens[0])
                except ValueError as e:  # cannot happen for a token sampled under its mask
                    output.failed[req.request_id] = str(e)
                    continue
            for tok in tokens:
                state.sampling.append(tok)
            output.sampled_token_ids[req.request_id] = tokens
            if entries is not None:
                output.logprobs[req.request_id] = entries
        for req, entry in read.prompt_logprobs:
            state = self._states[req.request_id]
            state.prompt_logprobs.append(entry)
            if len(state.prompt_logprobs) == req.num_prompt_tokens:
                state.prompt_logprobs_done = True
                output.prompt_logprobs[req.request_id] = state.prompt_logprobs
        for req, first, done, row in read.pooled:
            vector = self._pool_sums.add(req, first, done, row)
            if vector is not None:
                output.pooled[req.request_id] = vector
