"""ModelRunner: everything on the device -- the model, the KV block pool, every evaluation.

    LLMEngine (requests, scheduling, outputs)     ModelRunner (one per device / rank)
      plan_kv_cache(...) -> KVPlan           ->   probe activation memory, size the pool
      ensure_blocks(n, slots)                ->   create / grow the K/V (and state) arrays
      launch(SchedulerOutput[, previous]) -> StepHandle   flat arrays, model, sampler, async_eval
      collect(StepHandle) -> ModelRunnerOutput -> wait; sampled tokens as host lists

The K/V arrays are created by ensure_blocks, i.e. on the thread that steps the engine:
MLX cannot evaluate a lazy array on a thread other than the one that made it.

A step is built as a lazy graph (worker/step_build.py: the batch's flat token layout, the
forward, the sampler), evaluated here, and read back into the request states
(worker/step_results.py; worker/request_states.py keeps them between steps).

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
from dataclasses import dataclass

import mlx.core as mx

from mlxserve import ops
from mlxserve.core.scheduler import ModelRunnerOutput, SchedulerOutput
from mlxserve.cpu import install as cpu_backend
from mlxserve.kv_cache_spec import KVCacheLayout, uniform_layout
from mlxserve.models.base import KVCache
from mlxserve.models.contract import LayoutModel, Model, PipelineStageModel, ShardedModel
from mlxserve.models.fused import fuse_projections
from mlxserve.ops import AttentionMetadata
from mlxserve.ops.kv_quant import kv_pool_dtype
from mlxserve.worker.drafter import Drafter
from mlxserve.worker.isolation import KVCacheLostError, PoolSnapshot, bisect, describe
from mlxserve.worker.kv_inputs import probe_arguments
from mlxserve.worker.kv_transfer import StoredBlock, read_blocks, write_blocks
from mlxserve.worker.memory import (
    PROBE_TOKENS,
    KVPlan,
    agree_on_plan,
    plan_kv_cache,
    probe_activation_bytes,
    tree_bytes,
)
from mlxserve.worker.pool_watch import PoolWatch
from mlxserve.worker.pooling import PoolingSums
from mlxserve.worker.request_states import RequestStates
from mlxserve.worker.spmd import ForwardInputs, StepChannel
from mlxserve.worker.step_build import PreviousTokens, StepPart, build_part, sample_masked
from mlxserve.worker.step_results import commit, read_part

__all__ = ["KVCacheLostError", "ModelRunner", "StepHandle"]

logger = logging.getLogger("mlxserve")


@dataclass
class StepHandle:
    """A launched step: what to read back once its evaluation finishes."""

    scheduler_output: SchedulerOutput
    parts: list[StepPart]
    failed: dict[str, str]  # requests that failed while the step was built
    error: str | None = None  # mx.async_eval itself raised
    index: int = 0  # launches before this one and it: the latest has the runner's pool
    # Built, not started (launch(start=False)): the pool arrays it writes, i.e. the
    # previous step's, dropped when started: for the PoolWatch once that step is done, and
    # if that step fails, where its re-runs start from (this step is then built again on
    # the tokens they report, ModelRunner.collect).
    before: PoolSnapshot | None = None
    is_started: bool = False

    def previous_tokens(self) -> PreviousTokens | None:
        """This step's lazily sampled tokens, for a step launched before it is collected
        (async scheduling); None when it cannot feed one: it failed in part, was built
        in parts, or verified drafts (a request's token is not one row's)."""
        if self.failed or self.error is not None or len(self.parts) > 1:
            return None
        if not self.parts or not self.parts[0].samplers:
            return PreviousTokens(mx.zeros((0,), dtype=mx.int32), {})
        part = self.parts[0]
        if part.result is None or any(part.drafts) or part.proposal is not None:
            return None
        return PreviousTokens(
            part.result.token_ids, {r.request_id: i for i, r in enumerate(part.samplers)}
        )


class ModelRunner:
    """Owns the model and the KV pool; turns scheduled requests into sampled tokens."""

    def __init__(
        self,
        model: Model,
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
        # The CPU backend's fused forwards, also on what was made after loading (a
        # pipeline stage); nothing changes where the loader did not install it.
        cpu_backend.bind_forwards(model)
        # Tensor parallel (rank 0): every forward's inputs go to the other ranks first.
        self.channel = channel
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size: int = model.vocab_size
        self.kernels = kernels  # "auto" | "metal" | "fallback", checked at start-up
        # Adapted mlx-lm models say what each layer needs; hand-written ones are uniform.
        self.layout: KVCacheLayout = (
            model.kv_cache_layout
            if isinstance(model, LayoutModel)
            else uniform_layout(model.num_layers, model.num_kv_heads, model.head_dim)
        )
        self._takes_layout = isinstance(model, LayoutModel)
        dims = [d for _, k, v in self.layout.tensor_shapes for d in (k, v)]
        self.kv_dtype = kv_pool_dtype(kv_cache_dtype, dtype, dims)  # int8: 8-bit (kv_quant)
        self.kv_cache: KVCache | None = None  # made by the first ensure_blocks()
        self.pool_watch = PoolWatch()  # warns if a step copied the pool (not in place)
        # Speculative decoding with a draft model: set by the engine before planning.
        self.drafter: Drafter | None = None
        mx.random.seed(seed)
        self._states = RequestStates(seed)
        # Mean pooling over a prompt computed in chunks: the running sum of hidden states.
        self._pool_sums = PoolingSums()
        # Host time spent on grammar bitmasks, and in how many steps (bench/ reads them).
        self.num_mask_steps = 0
        self.mask_seconds = 0.0
        self._num_launches = 0

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
        if isinstance(self.model, ShardedModel):
            return self.model.tp_group
        if isinstance(self.model, PipelineStageModel):
            return self.model.pp_group
        return None

    def _check_lost(self, error: BaseException) -> None:
        """Re-raise a step's error as RankLostError when a tensor-parallel rank is gone:
        no per-request isolation then (every forward needs every rank)."""
        if self.channel is not None:
            self.channel.check(error)

    def _probe_args(self, md: AttentionMetadata) -> dict[str, object]:
        return probe_arguments(self.layout, md) if self._takes_layout else {}

    def read_blocks(self, block_ids: list[int]) -> list[StoredBlock]:
        """Copies of pool blocks (for the disk tier); call it with no step in flight."""
        assert self.kv_cache is not None
        return read_blocks(self.kv_cache, block_ids)

    def ensure_blocks(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """Make the K/V arrays hold at least ``num_blocks`` blocks and the state arrays
        ``num_state_slots`` slots (new ones zeroed).

        Call it on the thread that steps: MLX evaluates an array on the thread that made
        it. A new pool is lazy until the next launch evaluates it; a grown one is copied
        here, one array at a time, so each old array is freed before the next is copied
        (evaluated together, with the step, old and new pools were resident at once:
        growing 256 -> 512 blocks peaked at 1.33x the new pool's bytes, now ~1.02x).
        """
        if self.kv_cache is None:
            self.kv_cache = self._allocate(num_blocks, num_state_slots)
        else:
            before = (self.kv_cache.num_blocks, self.kv_cache.num_state_slots)
            self.kv_cache.ensure_num_blocks(num_blocks)
            self.kv_cache.ensure_num_state_slots(num_state_slots)
            if (self.kv_cache.num_blocks, self.kv_cache.num_state_slots) != before:
                for array in self.kv_cache.arrays():
                    mx.eval(array)
        if self.drafter is not None:
            self.drafter.ensure_blocks(num_blocks)

    def _allocate(self, num_blocks: int, num_state_slots: int = 2) -> KVCache:
        slots = num_state_slots if self.layout.has_state else 0
        return KVCache.allocate_layout(
            self.layout, num_blocks, self.block_size, self.kv_dtype, slots
        )

    def _snapshot(self) -> PoolSnapshot:
        assert self.kv_cache is not None, "ensure_blocks() comes before the first launch()"
        return PoolSnapshot.take(self.kv_cache, self.drafter)

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

    def launch(
        self, so: SchedulerOutput, previous: StepHandle | None = None, start: bool = True
    ) -> StepHandle:
        """Build the step's graph and start evaluating it; returns at once.

        The caller may do host work that does not need this step's results (the engine
        updates the scheduler and processes the previous step's outputs) before
        :meth:`collect`. Requests whose part of the graph cannot be built are left out and
        reported by collect(). ``previous``: the step launched before, not yet collected,
        whose sampled tokens feed this step's decodes with a placeholder input (async
        scheduling; ``previous.previous_tokens()`` must not be None).

        ``start=False``: only build it; :meth:`start` evaluates it, once ``previous`` is
        collected. MLX decides at dispatch whether a pool write may reuse its input's
        buffer: dispatched while the previous step still runs (its tasks hold that
        step's pool arrays), every layer's write copied its pool (measured: +30 ms a
        step, bench/README.md). So the engine builds the step ahead while the previous
        one computes, and dispatches it right after collecting that one.
        """
        for rid in so.finished_request_ids:
            self._states.drop(rid)
            self._pool_sums.drop(rid)
        if not so.scheduled_requests:
            return StepHandle(so, [], {})
        self._num_launches += 1
        handle = StepHandle(so, [], {}, index=self._num_launches)
        tokens = None
        if so.placeholder_request_ids:
            assert previous is not None, "a decode scheduled ahead needs the previous step"
            tokens = previous.previous_tokens()
            assert tokens is not None, "the previous step cannot feed a step launched ahead"
        if so.kv_loads:  # prefix blocks from the disk tier, before the step reads them
            write_blocks(self.kv_cache, so.kv_loads)
        if not start:
            handle.before = self._snapshot()
        handle.parts = self._build_isolating(so, handle.failed, tokens)
        if start:
            self.start(handle)
        return handle

    def start(self, handle: StepHandle) -> None:
        """Start evaluating a step built by ``launch(start=False)``; returns at once (a
        step started already is left alone)."""
        if handle.is_started:
            return
        handle.is_started = True
        if handle.before is not None:
            # The previous step is done: its pool arrays' buffers, for the watch (their
            # references dropped before this step's writes are dispatched).
            if len(handle.parts) == 1:
                rewrites = handle.parts[0].pool_writes > 1
                self.pool_watch.check(handle.before.arrays(), rewrites=rewrites)
            handle.before = None
        if not handle.parts:
            return
        outs = self._pool_arrays()
        for part in handle.parts:
            outs += part.arrays()
        try:
            mx.async_eval(*outs)  # the forward pass (and sampling, without grammars)
            del outs  # an MTP layer writes its pool again below: in place only if unheld
            masked = [part for part in handle.parts if part.result is None and part.samplers]
            if masked:
                # Grammar bitmasks on the host while the forward pass computes, then
                # the sampler of those parts on top of it.
                self._sample_masked(masked)
                # The pool too: an MTP layer writes it after those samplers (worker/mtp.py).
                mx.async_eval(*self._pool_arrays(), *(a for p in masked for a in p.arrays()))
        except Exception as e:  # noqa: BLE001 -- collect() finds whose fault it was
            self._check_lost(e)
            handle.error = describe(e)

    @staticmethod
    def release_thread() -> None:
        """Free the MLX streams of the calling thread; call it last in a thread that stepped.

        MLX leaves that cleanup to each thread (the main thread's runs at exit): skipped, a
        process that stepped on another thread aborted in its C++ teardown in 3 of 12 exits here.
        """
        mx.clear_streams()

    def collect(self, handle: StepHandle, ahead: StepHandle | None = None) -> ModelRunnerOutput:
        """Wait for a launched step; its sampled tokens (and logprobs) as host lists.

        If the step failed, it is re-run for halves of its requests; the requests that
        fail alone end up in ``failed`` (KVCacheLostError if the pool itself is lost).
        ``ahead``: the step built on this one's sampled tokens and not started yet (async
        scheduling); if this one fails, it is built again on the tokens the re-runs report.
        """
        output = ModelRunnerOutput({}, {}, {}, failed=dict(handle.failed))
        error = handle.error
        if error is None:
            try:
                reads = [read_part(part) for part in handle.parts]
            except Exception as e:  # noqa: BLE001 -- isolated below
                self._check_lost(e)
                error = describe(e)
            else:
                for read in reads:
                    commit(read, output, self._states, self._pool_sums)
                if len(handle.parts) > 1:  # a part's write copies a pool an earlier part reads
                    self.pool_watch.forget()
                elif handle.index != self._num_launches:
                    pass  # the pool arrays are a later step's, still computing: not now
                elif handle.parts and handle.parts[0].waited:  # else the pool may be in flight
                    rewrites = handle.parts[0].pool_writes > 1
                    self.pool_watch.check(self._pool_arrays(), rewrites=rewrites)
                return output
        so = handle.scheduler_output
        logger.warning(
            "a step of %d requests failed (%s); re-running it in parts to find the cause",
            len(so.scheduled_requests),
            error,
        )
        handle.parts = []  # drop the failed graph before re-running
        # The step built ahead reads the failed graph's pools and tokens: it goes too (its
        # pool writes with it), else settling the pool would evaluate the failed graph again.
        rebuild = ahead is not None and not ahead.is_started and ahead.before is not None
        if rebuild:
            ahead.before.restore(self.kv_cache, self.drafter)
            ahead.parts = []
        self.pool_watch.forget()  # the re-runs hold the old pool arrays: copies, on purpose
        self._settle_pool()
        # (Requests that ended since the step was built are not re-run: their rows are
        # discarded, and one fed a token only the device had cannot be built again.)
        live = [
            r
            for r in so.scheduled_requests
            if r.request_id not in output.failed and not r.is_finished
        ]
        bisect(so.subset(live), error, output.failed, lambda sub: self._rerun(sub, output))
        if rebuild:
            self._rebuild(ahead, output)
        return output

    def _rebuild(self, ahead: StepHandle, output: ModelRunnerOutput) -> None:
        """Build the step ahead again, its decodes fed the tokens ``output`` reports (those
        of the failed step's re-runs, not of its failed graph: near ties can differ between
        batches). A request that failed has none: it is fed 0, and its row is discarded
        (the engine ends it before that step is read)."""
        so = ahead.scheduler_output
        ids = sorted(so.placeholder_request_ids)
        sampled = output.sampled_token_ids
        tokens = [sampled[rid][-1] if sampled.get(rid) else 0 for rid in ids]
        previous = PreviousTokens(
            mx.array(tokens or [0], dtype=mx.int32), {rid: i for i, rid in enumerate(ids)}
        )
        ahead.failed.clear()
        ahead.before = self._snapshot()
        ahead.parts = self._build_isolating(so, ahead.failed, previous)

    def _rerun(self, so: SchedulerOutput, output: ModelRunnerOutput) -> str | None:
        """Run part of a failed step to the end; its error, or None once committed."""
        pool = self._snapshot()  # held during the eval: no donation, so a failure can restore
        try:
            parts = self._build_isolating(so, output.failed)
            self._sample_masked([p for p in parts if p.result is None and p.samplers])
            mx.eval(self._pool_arrays(), [p.arrays() for p in parts])
            reads = [read_part(part) for part in parts]
        except Exception as e:  # noqa: BLE001 -- the caller splits this part further
            self._check_lost(e)
            pool.restore(self.kv_cache, self.drafter)
            return describe(e)
        for read in reads:
            commit(read, output, self._states, self._pool_sums)
        return None

    def _build_isolating(
        self, so: SchedulerOutput, failed: dict[str, str], previous: PreviousTokens | None = None
    ) -> list[StepPart]:
        """Build the step's graph; if that raises, build halves (recursively) instead.

        Building evaluates nothing, so the pool arrays from before a failed build are
        intact and put back. They are held only while building: evaluation must be able
        to update the pool in place.
        """
        parts: list[StepPart] = []

        def build(sub: SchedulerOutput) -> str | None:
            pool = self._snapshot()
            try:
                with ops.use_kernels(self.kernels):
                    part = self._build(sub, previous)
            except Exception as e:  # noqa: BLE001 -- split and try again
                self._check_lost(e)
                pool.restore(self.kv_cache, self.drafter)
                return describe(e)
            del pool  # before evaluating: the old pool arrays would be copied, not donated
            if self.channel is not None and part.inputs is not None:
                # Tensor parallel: the other ranks run this forward too, in this order.
                self.channel.start(part.inputs, [self.kv_cache.arrays(), part.arrays()])
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

    def _build(self, so: SchedulerOutput, previous: PreviousTokens | None = None) -> StepPart:
        """The step's graph (worker/step_build.py), from this runner's model and pool."""
        assert self.kv_cache is not None
        return build_part(
            so,
            model=self.model,
            kv_cache=self.kv_cache,
            layout=self.layout,
            block_size=self.block_size,
            takes_layout=self._takes_layout,
            request_states=self._states,
            drafter=self.drafter,
            for_ranks=self.channel is not None,
            previous=previous,
        )

    def _sample_masked(self, parts: list[StepPart]) -> None:
        """Sample the parts that have grammar rows (worker/step_build.py), counting the
        host time their bitmasks take."""
        self.mask_seconds += sample_masked(parts, self._states)
        self.num_mask_steps += 1
