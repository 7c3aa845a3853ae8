"""ModelRunner: a SchedulerOutput in, one forward pass and one mx.eval, sampled tokens out.

Batch layout on the flat token axis (decodes first, as AttentionMetadata wants)::

    input_ids:  | d0 | d1 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    samples:      ^    ^                ^          ^      (last row of each request
                                                           whose chunk reaches its end)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxserve.core.request import Logprobs, Request
from mlxserve.core.scheduler import ModelRunnerOutput, SchedulerOutput
from mlxserve.ops import AttentionMetadata
from mlxserve.worker.sampler import (
    SamplerOutput,
    SamplingState,
    make_sampling_batch,
    sample,
    top_logprobs,
)


@dataclass
class _RequestState:
    """What the runner keeps per live request between steps."""

    sampling: SamplingState
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    # Set once the whole prompt is scored: a preempted request recomputes its prompt,
    # but its prompt logprobs are not computed (or reported) twice.
    prompt_logprobs_done: bool = False


@dataclass
class InFlightStep:
    """A launched step: what to read back once its evaluation finishes."""

    samplers: list[Request]
    result: SamplerOutput | None
    plp_targets: list[tuple[Request, int]]
    prompt_logprobs: tuple[mx.array, ...] | None


class ModelRunner:
    """Turns scheduled requests into flat arrays, runs the model, samples."""

    def __init__(self, model, kv_cache, block_size: int, vocab_size: int, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._states: dict[str, _RequestState] = {}

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            params = request.sampling_params
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            stop_ids = frozenset(request.eos_token_ids) | params.all_stop_token_ids
            sampling = SamplingState(params, seed, request.prompt_token_ids, stop_ids=stop_ids)
            for tok in request.output_token_ids:  # a preempted request resumes
                sampling.append(tok)
            state = _RequestState(sampling)
            self._states[request.request_id] = state
        return state

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step for every scheduled request (launch, then wait for it)."""
        return self.collect(self.launch(so))

    def launch(self, so: SchedulerOutput) -> InFlightStep:
        """Build the step's graph and start evaluating it; returns at once.

        The caller may do host work that does not need this step's results (the engine
        processes the previous step's outputs) before :meth:`collect`.
        """
        for rid in so.finished_request_ids:
            self._states.pop(rid, None)
        if not so.scheduled_requests:
            return InFlightStep([], None, [], None)
        # The scheduler orders decodes (one token each) first, as the attention op wants.
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        plp_rows: list[int] = []  # rows whose logits score the next prompt token
        plp_targets: list[tuple[Request, int]] = []  # (request, position of that token)
        for req in so.scheduled_requests:
            rid = req.request_id
            n = so.num_scheduled_tokens[rid]
            start = so.start_positions[rid]
            end = start + n
            row0 = len(input_ids)
            input_ids.extend(so.token_ids(req))
            positions.extend(range(start, end))
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
                sample_rows.append(row0 + n - 1)
                samplers.append(req)
        md = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size)
        rows = sample_rows + plp_rows
        logits = self.model(
            mx.array(input_ids, dtype=mx.int32),
            mx.array(positions, dtype=mx.int32),
            md,
            self.kv_cache,
            logits_indices=mx.array(rows, dtype=mx.int32) if rows else None,
        )
        outs: list[mx.array] = [*self.kv_cache.keys, *self.kv_cache.values]
        result = None
        if samplers:
            states = [self._states[r.request_id].sampling for r in samplers]
            result = sample(logits[: len(samplers)], make_sampling_batch(states, logits.shape[-1]))
            outs += [
                a
                for a in (result.token_ids, result.logprobs, result.top_ids, result.top_logprobs)
                if a is not None
            ]
        plp = None
        if plp_rows:
            plp = self._prompt_logprobs(logits[len(samplers) :], plp_targets)
            outs += list(plp)
        mx.async_eval(*outs)  # the one evaluation of this step
        return InFlightStep(samplers, result, plp_targets, plp)

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a launched step; its sampled tokens (and logprobs) as host lists."""
        output = ModelRunnerOutput(sampled_token_ids={}, logprobs={}, prompt_logprobs={})
        if step.result is not None:
            self._collect_samples(step.samplers, step.result, output)
        if step.prompt_logprobs is not None:
            self._collect_prompt_logprobs(step.plp_targets, step.prompt_logprobs, output)
        return output

    def _collect_samples(self, samplers: list[Request], result, output: ModelRunnerOutput) -> None:
        token_ids = np.array(result.token_ids).tolist()
        chosen = np.array(result.logprobs).tolist() if result.logprobs is not None else None
        top_ids = np.array(result.top_ids).tolist() if result.top_ids is not None else None
        top_lp = np.array(result.top_logprobs).tolist() if result.top_logprobs is not None else None
        for i, req in enumerate(samplers):
            tok = token_ids[i]
            self._states[req.request_id].sampling.append(tok)
            output.sampled_token_ids[req.request_id] = [tok]
            k = req.sampling_params.logprobs
            if k is not None and chosen is not None:
                entry: Logprobs = {tok: chosen[i]}
                if k and top_ids is not None:
                    for j in range(k):
                        entry.setdefault(top_ids[i][j], top_lp[i][j])
                output.logprobs[req.request_id] = entry

    def _prompt_logprobs(
        self, logits: mx.array, targets: list[tuple[Request, int]]
    ) -> tuple[mx.array, ...]:
        raw = logits.astype(mx.float32)
        logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # (R, V)
        target_ids = mx.array([r.prompt_token_ids[p] for r, p in targets], dtype=mx.int32)
        chosen = mx.take_along_axis(logprobs, target_ids[:, None], axis=-1)[:, 0]
        k = max(r.sampling_params.prompt_logprobs for r, _ in targets)
        if k == 0:
            return (chosen,)
        return (chosen, *top_logprobs(logprobs, k))

    def _collect_prompt_logprobs(self, targets, plp: tuple[mx.array, ...], output) -> None:
        chosen = np.array(plp[0]).tolist()
        tops = [np.array(a).tolist() for a in plp[1:]]
        for i, (req, pos) in enumerate(targets):
            state = self._states[req.request_id]
            entry: Logprobs = {req.prompt_token_ids[pos]: chosen[i]}
            for j in range(req.sampling_params.prompt_logprobs or 0):
                entry.setdefault(tops[0][i][j], tops[1][i][j])
            state.prompt_logprobs.append(entry)
            if len(state.prompt_logprobs) == req.num_prompt_tokens:
                state.prompt_logprobs_done = True
                output.prompt_logprobs[req.request_id] = state.prompt_logprobs
