"""LLMEngine: requests in, one scheduled forward pass per step(), RequestOutputs out.

__init__:    startup.start_runner (ranks, ModelRunner, drafter, KV plan) -> Scheduler
add_request -> admission (tokenize, checks) -> ParallelSampling (n > 1) -> Scheduler.add_request
step():  Scheduler.schedule() -> ModelRunner.launch() / collect() -> Scheduler.update_from_output()
         -> OutputProcessor (detokenize, stop strings) -> list[RequestOutput]

Async scheduling (``EngineConfig.async_scheduling``, vLLM's ``--async-scheduling``, on by
default): step N+1 is scheduled and built before step N is collected, its decodes fed N's
sampled tokens on the device, and dispatched as soon as N is collected; so the host's
Python (schedule and build N+1, then update and process N) runs while the device computes::

    sync:   | sched+build N | dispatch | wait N | update+process N | sched+build N+1 | ...
    async:  | sched+build N+1 | wait N | dispatch N+1 | update+process N | sched+build N+2
    device:     ...compute N ......... |   ...compute N+1 ...............................|

(N+1 is dispatched only once N is done: see ModelRunner.launch's ``start``.)

A step is scheduled ahead only when nothing running needs the previous token on the host
to build it (core/scheduler.needs_host_tokens: penalties, grammars, embeddings, prompt
logprobs) and the engine has neither speculative decoding, other ranks (tensor / pipeline
parallel), nor recurrent state (models/ with a state layout); otherwise that step runs in
the synchronous order. Outputs are the same token for token either way.

The engine keeps requests, scheduling and outputs; the ModelRunner owns the device (model,
KV arrays, every evaluation). A request whose step fails ends alone with finish_reason
"error" (RequestOutput.error says why); the others in the batch go on, token-exact.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from mlxserve import ops, settings
from mlxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from mlxserve.core.request import Request, RequestOutput, RequestStatus
from mlxserve.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput, SchedulerStats
from mlxserve.engine import admission
from mlxserve.engine.cache_stats import CacheStats, CacheTier
from mlxserve.engine.kv_disk import open_disk_tier
from mlxserve.engine.model_info import ModelInfo, config_facts
from mlxserve.engine.output_processor import OutputProcessor
from mlxserve.engine.parallel_sampling import ParallelSampling
from mlxserve.engine.startup import (
    default_max_num_batched_tokens,
    log_prefix_caching,
    prefix_caching_off,
    snapshot_interval,
    speculation,
    start_runner,
)
from mlxserve.loader import LoadedModel, load_model
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams
from mlxserve.structured_output.grammar import GrammarCompiler, StructuredOutputRequest
from mlxserve.utils import release_free_memory
from mlxserve.worker import metal_memory
from mlxserve.worker.isolation import describe
from mlxserve.worker.memory import tree_bytes
from mlxserve.worker.model_runner import KVCacheLostError, StepHandle
from mlxserve.worker.spmd import RankLostError

logger = logging.getLogger("mlxserve")

# KV blocks that exist at start; the pool grows (doubling) up to the planned size as
# requests need more, so a small job never commits the whole memory budget.
INITIAL_KV_BLOCKS = 256


def finish_embedding(vector: list[float], pooling: PoolingParams) -> list[float]:
    """A pooled hidden state as the user asked: its first ``dimensions`` values, unit norm."""
    v = np.asarray(vector, dtype=np.float64)[: pooling.dimensions]
    if pooling.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.tolist()


class LLMEngine:
    """The synchronous engine: call step() while has_unfinished_requests()."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        settings.start()  # the process settings, validated; the BLAS bound (once)
        ops.check_kernels(config.kernels)  # before loading: fail fast on this machine
        if loaded is None:
            loaded = load_model(
                config.model,
                dtype=config.dtype,
                revision=config.revision,
                tokenizer=config.tokenizer,
            )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_templates = config.chat_template
            self.tokenizer.chat_format = "jinja"  # the user's template wins over harmony too
        self.model_name = config.served_model_name or loaded.source.name
        # Embeddings: how the hidden states are pooled, their size, and whether the model
        # was trained (Matryoshka) so that a prefix of the vector is an embedding too.
        self.pooling_method = loaded.pooling
        self.embedding_size = int(loaded.config.get("hidden_size", 0))
        self.is_matryoshka = bool(
            loaded.config.get("is_matryoshka") or loaded.config.get("matryoshka_dimensions")
        )
        self.max_num_batched_tokens = (
            config.max_num_batched_tokens or default_max_num_batched_tokens()
        )
        started = start_runner(config, loaded, self.max_num_batched_tokens)
        # Tensor / pipeline parallel: the other ranks, started there; None in one process.
        self.ranks = started.ranks
        self.runner = started.runner
        self.plan = started.plan
        logger.info(self.plan.describe(config.max_num_seqs, self.max_num_batched_tokens))
        # On Metal: keep weights + pool resident, cap the buffer cache to the plan's slack.
        metal_memory.configure(
            tree_bytes(loaded.model.parameters()), self.plan.kv_bytes, config.memory_fraction
        )
        self.max_model_len = self.plan.max_model_len
        layout = self.runner.layout
        self.speculative_config = speculation(config.speculative_config, layout)
        self.scheduler = Scheduler(
            SchedulerConfig(self.max_model_len, config.max_num_seqs, self.max_num_batched_tokens),
            CacheConfig(
                self.plan.num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                min(self.plan.num_blocks, INITIAL_KV_BLOCKS),
                groups=layout.groups,
                num_state_slots=self.plan.num_state_slots,
                snapshot_interval=snapshot_interval(
                    layout, config.block_size, self.runner.kv_dtype
                ),
            ),
            self.speculative_config,
            clock=time.perf_counter,
        )
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.state_pool = self.scheduler.kv_cache_manager.state_pool
        # Why prefix caching is off (None: on); the start-up log and /metrics say so.
        self.prefix_caching_off = prefix_caching_off(config.enable_prefix_caching)
        self.kv_store = open_disk_tier(
            config,
            loaded,
            layout,
            self.runner.kv_dtype,
            prefix_caching_off=self.prefix_caching_off,
            parallel=self.ranks is not None,
            drafter=self.runner.drafter is not None,
        )
        if self.kv_store is not None:
            self.scheduler.kv_cache_manager.store = self.kv_store
            self.block_pool.pending_saves = {}
        log_prefix_caching(self.prefix_caching_off, layout.has_state)
        self.fanout = ParallelSampling()
        self.outputs = OutputProcessor(self.tokenizer, self.fanout)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        # The step launched and not yet collected (async scheduling keeps one between calls).
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # Whether steps may be scheduled ahead (see _step): N+1 is built before N's tokens
        # reach the host, so all of the engine's Python overlaps the compute, not only
        # N's output processing.
        self.async_scheduling = config.async_scheduling and not (
            self.ranks is not None
            or self.runner.channel is not None
            or self.speculative_config is not None
            or self.runner.drafter is not None
            or layout.has_state
        )
        # Prompt tokens computed so far (prefix-cache hits excluded), for throughput logs.
        self.num_prompt_tokens_computed = 0
        # Loading and planning left freed buffers in MLX's cache and the C heap: hand
        # them back before serving (the KV pool is made by the first step).
        release_free_memory()

    @property
    def model(self):
        """The model (the runner holds it; read its attributes, never run it from here)."""
        return self.runner.model

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def describe(self) -> ModelInfo:
        """The served model, for front-ends (the server reads nothing else of the engine)."""
        cfg = self.loaded.config
        return ModelInfo(
            name=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            weight_bytes=tree_bytes(self.model.parameters()),
            architecture=str(cfg.get("model_type", "")),
            file_format="gguf" if self.loaded.source.kind == "gguf" else "safetensors",
            config_facts=config_facts(cfg),
            tokenizer=self.tokenizer,
        )

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
        structured_output: StructuredOutputRequest | None = None,
    ) -> None:
        """Queue a request; ParameterError (naming the field, with the numbers) if it
        can never run (the checks live in engine/admission.py).

        With ``pooling_params`` it is an embedding request: the prompt is computed
        (prefill only, batched with everything else) and its output carries ``embedding``.
        ``structured_output`` is ``compile_structured_output(params)`` done beforehand
        (AsyncLLM compiles off the engine thread); otherwise it is compiled here.
        """
        if pooling_params is not None:
            admission.check_pooling(pooling_params, self.embedding_size, self.is_matryoshka)
            params = SamplingParams(max_tokens=1)
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        prompt_token_ids = admission.prompt_token_ids_of(self.tokenizer, prompt, prompt_token_ids)
        max_tokens = admission.check_request(
            prompt_token_ids, params, self.vocab_size, self.max_model_len
        )
        if structured_output is None:
            structured_output = self.compile_structured_output(params)
        parent = self.fanout.add(request_id, params)  # reserves the n engine ids
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self.outputs.add(parent, text, prompt_token_ids, arrival)
        try:
            first = parent.make_requests(
                prompt_token_ids, self.eos_token_ids, max_tokens, arrival, structured_output
            )
            if pooling_params is not None:
                first.pooling = self.pooling_method
                self.outputs.states[request_id].pooling = pooling_params
            self.scheduler.add_request(first)
        except ValueError:
            self._forget(request_id)
            raise

    def compile_structured_output(
        self, params: SamplingParams, starts_after: str | None = None
    ) -> StructuredOutputRequest | None:
        """The compiled constraint of ``params`` (None without one); ParameterError if it
        is invalid or cannot be combined with the other params. Thread-safe: call it off
        the engine thread for large schemas. ``starts_after``: the constraint applies only
        to the output after this text (e.g. "</think>" for a reasoning model)."""
        return admission.compile_structured_output(self.grammars, params, starts_after)

    def num_cached_tokens(self, request_id: str) -> int | None:
        """How many of the request's prompt tokens the prefix cache held, known from its
        first scheduling on (None before, or once it is gone). Safe from any thread: one
        dict read and one int read."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.num_cached_tokens < 0:
            return None
        return request.num_cached_tokens

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finals = [self._end(rid) for rid in ids]
        return [out for out in finals if out is not None]

    def _end(
        self, request_id: str, error: str | None = None, delta: bool = False
    ) -> RequestOutput | None:
        """Finish a user request now: aborted, or failed with ``error``; its last output."""
        parent = self.fanout.get(request_id)
        if parent is None:
            return None
        status = RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
        self.scheduler.finish_requests(parent.child_ids, status)
        state = self.outputs.abort(request_id, error)
        out = None if state is None else self.outputs.make_output(state, delta=delta)
        self._forget(request_id)
        return out

    def _forget(self, request_id: str) -> None:
        self.outputs.remove(request_id)
        self.fanout.remove(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; the number of blocks that held one. Between requests
        only (blocks in use would stay allocated, but recurrent states would be lost)."""
        assert not self.has_unfinished_requests()
        num_cached = self.scheduler.kv_cache_manager.block_pool.num_cached_blocks
        self.scheduler.reset_prefix_cache()
        return num_cached

    def _save_blocks(self) -> None:
        """Copy the blocks registered since the last call to the disk tier (with no step in
        flight: the pool holds their final values; the writes happen on another thread)."""
        if self.kv_store is None:
            return
        pending = self.block_pool.take_pending_saves()
        if not pending:
            return
        blocks = self.runner.read_blocks([block_id for block_id, _, _ in pending])
        for (_, block_hash, token_ids), block in zip(pending, blocks, strict=True):
            self.kv_store.put(block_hash, token_ids, block)

    def cache_stats(self) -> CacheStats:
        """The prefix cache's blocks and counters. Safe from any thread (integer reads;
        the counts of one call may be a step apart)."""
        kv = self.scheduler.kv_cache_manager
        pool = kv.block_pool
        usable = self.plan.num_blocks - 1
        per_block = self.plan.bytes_per_block
        cached = pool.num_cached_blocks
        in_pool = kv.prefix_cache_hits - kv.prefix_cache_hits_stored
        tiers = [
            CacheTier(
                "pool", usable, usable - pool.get_num_free_blocks(), cached, per_block,
                cached * per_block, in_pool,
            )
        ]  # fmt: skip
        if self.kv_store is not None:
            store = self.kv_store
            files, size = store.num_blocks, store.num_bytes
            per_file = size // files if files else per_block
            tiers.append(
                CacheTier(
                    "disk", store.budget // max(per_file, 1), 0, files, per_file, size,
                    kv.prefix_cache_hits_stored,
                )
            )  # fmt: skip
        return CacheStats(
            enabled=self.prefix_caching_off is None,
            block_size=self.plan.block_size,
            tiers=tuple(tiers),
            query_tokens=kv.prefix_cache_queries,
            hit_tokens=kv.prefix_cache_hits,
            num_requests=kv.prefix_cache_requests,
            num_requests_hit=kv.prefix_cache_requests_hit,
        )

    def has_unfinished_requests(self) -> bool:
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
            or self.fanout.has_held()
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.states)

    # ------------------------------------------------------------------- step
    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Advance by one forward pass (see :meth:`_step`); RankLostError if a
        tensor-parallel rank is gone: the other ranks are stopped, the engine is dead."""
        if self.ranks is None:
            return self._step(delta)
        self.ranks.progress.begin("a step")
        try:
            return self._step(delta)
        except RankLostError:
            logger.error("a %s rank is gone; stopping the others", self.ranks.name)
            self.ranks.kill()
            raise
        finally:
            self.ranks.progress.end()

    def shutdown(self) -> None:
        """Write what the disk tier has still to keep, and stop the other tensor-parallel
        ranks. Call it on the thread that steps; the engine cannot step afterwards."""
        if self.kv_store is not None:
            if self._in_flight is None:
                self._save_blocks()
            self.kv_store.close()  # its writer thread ends with the engine
        if self.ranks is None:
            return
        ranks, self.ranks = self.ranks, None
        if ranks.lost() is None and self.runner.channel is not None:
            ranks.progress.begin("shutdown")
            try:
                self.runner.channel.stop()
            except RankLostError:
                pass
            finally:
                ranks.progress.end()
        ranks.wait()

    def _step(self, delta: bool = False) -> list[RequestOutput]:
        """Advance by one forward pass; outputs of the requests that changed.

        Synchronous order: schedule N, launch it, collect it (wait for its tokens), update
        the scheduler, process the outputs. Async scheduling (when :meth:`_may_schedule_ahead`):
        step N was launched by the previous call; schedule and launch N+1 first, then
        collect N and return its outputs, leaving N+1 in flight. Either way a call returns
        the outputs of the step it collected. A request ended by step N (EOS, stop string,
        abort between calls) may have been computed in N+1 too: that token is discarded.
        A request the runner reports as failed ends with finish_reason "error".
        """
        if self._in_flight is None:
            self._in_flight = self._launch()
            if self._in_flight is None:
                return []
        current = self._in_flight
        ahead = self._launch(current[1]) if self._may_schedule_ahead() else None
        self._in_flight = ahead
        try:
            collected = self._collect(current, delta, ahead)
        finally:
            if ahead is not None and self._in_flight is ahead:
                self.runner.start(ahead[1])  # (started already unless collect raised)
        if isinstance(collected, list):  # the KV pool is lost: every request failed
            return collected
        outputs = self._process(*collected, delta=delta)
        if self._in_flight is None:
            self._flush_finished()
            if not self.has_unfinished_requests():
                self._save_blocks()  # idle: what the last requests computed goes to disk
        return outputs

    def _may_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled before the one in flight is collected:
        async scheduling is on for this engine, no live request needs its previous token
        on the host, and the step in flight can feed its sampled tokens on the device."""
        return (
            self.async_scheduling
            and not self.scheduler.sync_request_ids
            and self._in_flight is not None
            and self._in_flight[1].previous_tokens() is not None
        )

    def _launch(
        self, previous: StepHandle | None = None
    ) -> tuple[SchedulerOutput, StepHandle] | None:
        """Schedule a step and launch it (None: nothing to compute). ``previous``: the step
        in flight, when this one is scheduled ahead of its collection."""
        if previous is None:
            self._save_blocks()
        so = self.scheduler.schedule()
        if not so.scheduled_requests:
            if so.finished_request_ids:  # only finished requests: the runner drops them
                self.scheduler.update_from_output(so, self.runner.collect(self.runner.launch(so)))
            return None
        slots = self.state_pool.num_allocated_slots if self.state_pool is not None else 0
        # Growing the pool evaluates it: a step in flight finishes first (stream order).
        self.runner.ensure_blocks(self.block_pool.num_allocated_blocks, slots)
        try:
            handle = self.runner.launch(so, previous, start=previous is None)
        except Exception:
            parents = {self.fanout.owner(r.request_id)[0] for r in so.scheduled_requests}
            self.abort_request([p.request_id for p in parents])
            raise
        self._note_scheduled(so)
        return so, handle

    def _flush_finished(self) -> None:
        """Pass requests that finished to the runner (it frees their state) when no step
        follows to carry them."""
        if self.scheduler.finished_request_ids and not self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()  # nothing to compute: only the finished ids
            self.scheduler.update_from_output(so, self.runner.collect(self.runner.launch(so)))

    def _collect(
        self,
        step: tuple[SchedulerOutput, StepHandle],
        delta: bool,
        ahead: tuple[SchedulerOutput, StepHandle] | None = None,
    ) -> tuple | list[RequestOutput]:
        """Wait for a launched step: (its SchedulerOutput, ModelRunnerOutput, the
        requests it changed, outputs of the requests it failed); or, if the KV pool was
        lost, the final outputs of every request. ``ahead``: the step built ahead of this
        one, dispatched as soon as this one is done (before the scheduler's update)."""
        so, handle = step
        try:
            ro = self.runner.collect(handle, None if ahead is None else ahead[1])
        except KVCacheLostError as e:
            self._in_flight = None  # the step ahead wrote the lost pool: never started
            return self._fail_everything(str(e), delta)
        if ahead is not None:
            self.runner.start(ahead[1])
        failures = self._fail(ro.failed, delta)
        return (so, ro, self.scheduler.update_from_output(so, ro), failures)

    def _fail(self, failed: dict[str, str], delta: bool) -> list[RequestOutput]:
        """End the user requests of engine requests whose step failed; their outputs."""
        outs = []
        for engine_id, error in failed.items():
            parent = self.fanout.parent_of(engine_id)
            if parent is not None:
                message = f"internal error while running this request: {error}"
                outs.append(self._end(parent.request_id, message, delta))
        return [out for out in outs if out is not None]

    def _fail_everything(self, error: str, delta: bool) -> list[RequestOutput]:
        """The KV pool is lost: fail every request and forget the cached prefixes."""
        logger.error("%s; failing every request", error)
        message = f"internal error: {error}"
        outs = [self._end(rid, message, delta) for rid in list(self.fanout.parents)]
        self.scheduler.reset_prefix_cache()
        return [out for out in outs if out is not None]

    def _note_scheduled(self, so: SchedulerOutput) -> None:
        now = time.monotonic()
        for req in so.scheduled_requests:
            n = so.num_scheduled_tokens[req.request_id]
            start = so.start_positions[req.request_id]
            self.num_prompt_tokens_computed += max(0, min(start + n, req.num_prompt_tokens) - start)
            m = self.outputs.metrics_of(req.request_id)
            if m is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = now
                if logger.isEnabledFor(logging.DEBUG):
                    self._log_prefix_hit(req)

    def _log_prefix_hit(self, req: Request) -> None:
        """Where a request's prompt left the prefix cache: the tokens around the first one
        computed (a block that differs from every cached one, or was evicted)."""
        hit, total = req.num_cached_tokens, req.num_prompt_tokens
        if hit <= 0 or hit >= total - 1:
            logger.debug("request %s: %d of %d prompt tokens cached", req.request_id, hit, total)
            return
        ids = req.prompt_token_ids
        before = self.tokenizer.decode(ids[max(0, hit - 12) : hit], False)
        after = self.tokenizer.decode(ids[hit : hit + self.plan.block_size], False)
        stored = req.num_stored_tokens
        tiers = f"pool {hit - stored}, disk {stored}" if stored else "pool"
        logger.debug(
            "request %s: %d of %d prompt tokens cached (%s); the cache ends at token %d, "
            "between %r and the block %r",
            req.request_id, hit, total, tiers, hit, before, after,
        )  # fmt: skip

    def _process(
        self,
        so: SchedulerOutput,
        ro: ModelRunnerOutput,
        changed: list[Request],
        failures: list[RequestOutput],
        delta: bool,
    ) -> list[RequestOutput]:
        touched = {}
        for req in changed:
            if self.fanout.parent_of(req.request_id) is None:
                continue  # a sibling sample failed earlier in this loop: the request ended
            new = ro.sampled_token_ids.get(req.request_id, [])
            if req.pooling is not None:
                vector = ro.pooled[req.request_id]
                state = self.outputs.states[self.fanout.owner(req.request_id)[0].request_id]
                state.embedding = finish_embedding(vector, state.pooling)
            logprobs = (ro.logprobs or {}).get(req.request_id)
            plp = (ro.prompt_logprobs or {}).get(req.request_id)
            try:
                state, hit_stop = self.outputs.process(req, new, logprobs, plp)
            except Exception as e:  # noqa: BLE001 -- e.g. the detokenizer: fail this one only
                logger.exception("processing the output of request %s failed", req.request_id)
                parent_id = self.fanout.owner(req.request_id)[0].request_id
                touched.pop(parent_id, None)
                failures += self._fail({req.request_id: describe(e)}, delta)
                continue
            if hit_stop:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
            # Sample 0 has prefilled: its prompt blocks are cached, the held samples hit them.
            for sibling in self.fanout.release_held(req.request_id):
                self.scheduler.add_request(sibling)
        results = failures
        for rid, state in touched.items():
            results.append(self.outputs.make_output(state, delta=delta))
            if state.finished:
                self._forget(rid)
        return results

    def get_stats(self) -> SchedulerStats:
        """Scheduler and cache gauges (running, waiting, KV usage, prefix counters)."""
        return self.scheduler.make_stats()
