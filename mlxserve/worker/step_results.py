"""Reading a step's results back: the sampled tokens to the host, then into the states.

A part of a step is read in two moves, so that a failure while reading (the evaluation
raised) leaves every request state as it was and the part can be re-run::

    read_part(part) -> StepRead     wait; token ids, logprobs, pooled rows as host lists
    commit(read, output, ...)       append to the request states and the step's output

A request with speculative drafts (worker/step_build.py) keeps the drafts its rows
accepted and the token of the first row whose draft is rejected (or of the last row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlxserve.core.request import Logprobs, Request
from mlxserve.core.scheduler import ModelRunnerOutput
from mlxserve.worker.pooling import PoolingSums
from mlxserve.worker.request_states import RequestStates
from mlxserve.worker.step_build import StepPart


@dataclass
class StepRead:
    """A part's results on the host, not yet applied to the request states."""

    samples: list[tuple[Request, list[int], list[Logprobs] | None]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Request, Logprobs]] = field(default_factory=list)
    pooled: list[tuple[Request, bool, bool, np.ndarray]] = field(default_factory=list)


def read_part(part: StepPart) -> StepRead:
    """Wait for a part and copy its results to the host (request states untouched)."""
    read = StepRead()
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


def commit(
    read: StepRead,
    output: ModelRunnerOutput,
    request_states: RequestStates,
    pool_sums: PoolingSums,
) -> None:
    """Apply a part's results to the request states and the step's output."""
    # A request that ended after this step was launched (async scheduling: the step was
    # scheduled before its previous token, an EOS or a stop string, was known; or an
    # abort) gets nothing: its extra token is discarded, its state may be gone.
    for req, entry in read.prompt_logprobs:
        if req.is_finished:
            continue
        state = request_states[req.request_id]
        state.prompt_logprobs.append(entry)
        state.prompt_logprobs_done = len(state.prompt_logprobs) == req.num_prompt_tokens
    for req, tokens, entries in read.samples:
        if req.is_finished:
            continue
        state = request_states[req.request_id]
        # The prompt's logprobs go out with its first token: the engine reports a request
        # in the steps it samples in, and the last prompt token (it has no logprob of
        # its own) may be a chunk after the one that scored the rest.
        if state.prompt_logprobs_done and not state.prompt_logprobs_sent:
            output.prompt_logprobs[req.request_id] = state.prompt_logprobs
            state.prompt_logprobs_sent = True
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
    for req, first, done, row in read.pooled:
        vector = pool_sums.add(req, first, done, row)
        if vector is not None:
            output.pooled[req.request_id] = vector
