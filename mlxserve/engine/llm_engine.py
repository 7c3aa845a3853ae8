"""LLMEngine: requests in, one scheduled forward pass per step(), RequestOutputs out.

add_request -> tokenizer -> Scheduler.add_request
step():  Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update_from_output()
         -> OutputProcessor (detokenize, stop strings) -> list[RequestOutput]
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from mlxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from mlxserve.core.request import Request, RequestOutput, RequestStatus
from mlxserve.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput, SchedulerStats
from mlxserve.engine.output_processor import OutputProcessor
from mlxserve.loader import LoadedModel, load_model
from mlxserve.models.base import KVCache
from mlxserve.ops import AttentionMetadata
from mlxserve.sampling_params import SamplingParams
from mlxserve.utils import cdiv, uses_gpu
from mlxserve.worker.memory import KVPlan, kv_bytes_per_token, plan_kv_cache, tree_bytes
from mlxserve.worker.model_runner import InFlightStep, ModelRunner

logger = logging.getLogger("mlxserve")

# Tokens in the start-up probe that measures activation memory per token (small: on
# the CPU backend a forward pass costs ~0.1 s per token of a 135M model).
PROBE_TOKENS = 8
# KV blocks that exist at start; the pool grows (doubling) up to the planned size as
# requests need more, so a small job never commits the whole memory budget.
INITIAL_KV_BLOCKS = 256
# Default token budget per step. Offline jobs and the one-user chat want throughput:
# big prefill chunks. A server on the CPU wants small ones: there a step's time grows
# with its tokens (~5 ms per prompt token for a 135M model), so a large chunk stalls
# every decoding stream (bench/README.md, "mixed": budget 64 -> ITL p99/p50 3.4, 32 -> 1.6).
# On Metal a prefill chunk costs little next to the decodes sharing its step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 32


def default_max_num_batched_tokens(serving: bool = False) -> int:
    """The step token budget when the config leaves it unset (None)."""
    if serving and not uses_gpu():
        return CPU_SERVING_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS


class LLMEngine:
    """The synchronous engine: call step() while has_unfinished_requests()."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            loaded = load_model(
                config.model,
                dtype=config.dtype,
                revision=config.revision,
                tokenizer=config.tokenizer,
            )
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_templates = config.chat_template
        self.model_name = config.served_model_name or loaded.source.name
        self.max_num_batched_tokens = (
            config.max_num_batched_tokens or default_max_num_batched_tokens()
        )
        mx.random.seed(config.seed)
        self.plan = self._plan_memory()
        logger.info(self.plan.describe(config.max_num_seqs))
        self.max_model_len = self.plan.max_model_len
        initial_blocks = min(self.plan.num_blocks, INITIAL_KV_BLOCKS)
        self.kv_cache = self._allocate_kv_cache(initial_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(self.max_model_len, config.max_num_seqs, self.max_num_batched_tokens),
            CacheConfig(
                self.plan.num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                initial_blocks,
            ),
        )
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.runner = ModelRunner(
            self.model, self.kv_cache, config.block_size, self.model.vocab_size, seed=config.seed
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # n > 1: samples after the first wait until it has prefilled, then hit its blocks.
        self._pending_siblings: dict[str, list[Request]] = {}
        self._in_flight: tuple[SchedulerOutput, InFlightStep] | None = None
        # Prompt tokens computed so far (prefix-cache hits excluded), for throughput logs.
        self.num_prompt_tokens_computed = 0

    # ----------------------------------------------------------------- set-up
    def _plan_memory(self) -> KVPlan:
        c = self.config
        model_len = self.model.max_position_embeddings or c.max_model_len or 4096
        bytes_per_token = kv_bytes_per_token(
            self.model.num_layers, self.model.num_kv_heads, self.model.head_dim, self.loaded.dtype
        )
        activation = 0
        if c.num_blocks is None:
            activation = self._probe_activation_bytes()
        return plan_kv_cache(
            bytes_per_token=bytes_per_token,
            block_size=c.block_size,
            model_max_len=model_len,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            memory_fraction=c.memory_fraction,
            weights_bytes=tree_bytes(self.model.parameters()),
            activation_bytes=activation,
            num_blocks=c.num_blocks,
        )

    def _allocate_kv_cache(self, num_blocks: int) -> KVCache:
        """Zeroed K/V pools of ``num_blocks`` blocks for this model (lazy until evaluated)."""
        return KVCache.allocate(
            self.model.num_layers,
            num_blocks,
            self.config.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            dtype=self.loaded.dtype,
        )

    def _probe_activation_bytes(self) -> int:
        """Peak memory of a forward pass per token, measured, times the token budget."""
        bs = self.config.block_size
        n = min(PROBE_TOKENS, self.max_num_batched_tokens)
        num_blocks = cdiv(n, bs) + 1
        cache = self._allocate_kv_cache(num_blocks)
        md = AttentionMetadata.build([n], [n], [list(range(1, num_blocks))], bs)
        mx.eval(cache.keys, cache.values)
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        logits = self.model(
            mx.zeros((n,), mx.int32),
            mx.arange(n, dtype=mx.int32),
            md,
            cache,
            logits_indices=mx.array([n - 1], dtype=mx.int32),
        )
        mx.eval(logits)
        per_token = max(mx.get_peak_memory() - base, 0) / n
        del cache, logits
        mx.clear_cache()
        return int(per_token * self.max_num_batched_tokens)

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; ValueError (with the numbers) if it can never run."""
        params = params or SamplingParams()
        if request_id in self.outputs.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        max_tokens = self._max_tokens(len(prompt_token_ids), params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        requests = []
        for i, cid in enumerate(
            self.outputs.add(request_id, text, prompt_token_ids, params, arrival)
        ):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = _with_seed(params, params.seed + i)
            requests.append(
                Request(
                    cid, prompt_token_ids, child_params, self.eos_token_ids, max_tokens, arrival
                )
            )
        try:
            self.scheduler.add_request(requests[0])
        except ValueError:
            self.outputs.remove(request_id)
            raise
        if len(requests) > 1:
            self._pending_siblings[requests[0].request_id] = requests[1:]

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt is {prompt_len} tokens, but max_model_len is {self.max_model_len}: "
                f"it must be at most {self.max_model_len - 1} tokens to generate anything"
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens {params.max_tokens} + prompt {prompt_len} tokens = "
                f"{params.max_tokens + prompt_len} exceeds max_model_len {self.max_model_len}; "
                f"use max_tokens <= {room}"
            )
        return params.max_tokens

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finals = []
        for rid in ids:
            children = self.outputs.child_ids(rid)
            if not children:
                continue
            self._pending_siblings.pop(children[0], None)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            state = self.outputs.abort(rid)
            if state is not None:
                finals.append(self.outputs.make_output(state))
                self.outputs.remove(rid)
        return finals

    def has_unfinished_requests(self) -> bool:
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
            or bool(self._pending_siblings)
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.states)

    # ------------------------------------------------------------------- step
    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Advance by one forward pass; outputs of the requests that changed.

        Pipelined: the step launched by the previous call is collected first, the next
        one is scheduled and launched, and the collected step's outputs are detokenized
        while the new one computes. So outputs trail the launch by one call, and a
        request stopped by a stop string may have computed one extra token, discarded.
        """
        collected = None
        if self._in_flight is not None:
            so, handle = self._in_flight
            self._in_flight = None
            ro = self.runner.collect(handle)
            collected = (so, ro, self.scheduler.update_from_output(so, ro))
        so = self.scheduler.schedule()
        if so.scheduled_requests or so.finished_request_ids:
            self.kv_cache.ensure_num_blocks(self.block_pool.num_allocated_blocks)
            try:
                self._in_flight = (so, self.runner.launch(so))
            except Exception:
                self.abort_request(
                    [self.outputs.parent_id(r.request_id) for r in so.scheduled_requests]
                )
                raise
            self._note_scheduled(so)
        if collected is None:
            return []
        return self._process(*collected, delta=delta)

    def _note_scheduled(self, so: SchedulerOutput) -> None:
        now = time.monotonic()
        for req in so.scheduled_requests:
            n = so.num_scheduled_tokens[req.request_id]
            start = so.start_positions[req.request_id]
            self.num_prompt_tokens_computed += max(0, min(start + n, req.num_prompt_tokens) - start)
            m = self.outputs.metrics_of(req.request_id)
            if m is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = now

    def _process(
        self, so: SchedulerOutput, ro: ModelRunnerOutput, changed: list[Request], delta: bool
    ) -> list[RequestOutput]:
        touched = {}
        for req in changed:
            new = ro.sampled_token_ids.get(req.request_id, [])
            logprobs = (ro.logprobs or {}).get(req.request_id)
            plp = (ro.prompt_logprobs or {}).get(req.request_id)
            state, hit_stop = self.outputs.process(req, new, logprobs, plp)
            if hit_stop:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
            siblings = self._pending_siblings.pop(req.request_id, None)
            if siblings:  # the first sample has prefilled: its prompt blocks are cached now
                for sib in siblings:
                    self.scheduler.add_request(sib)
        results = []
        for rid, state in touched.items():
            results.append(self.outputs.make_output(state, delta=delta))
            if state.finished:
                self.outputs.remove(rid)
        return results

    def get_stats(self) -> SchedulerStats:
        """Scheduler and cache gauges (running, waiting, KV usage, prefix counters)."""
        return self.scheduler.make_stats()


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import copy

    out = copy.copy(params)
    out.seed = seed
    return out
