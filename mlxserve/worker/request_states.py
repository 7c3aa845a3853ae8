"""What the runner keeps per live request between steps: its sampling state, its place in
a grammar, the prompt logprobs scored so far.

A state is made on a request's first step (or again after it was lost: the request's
output tokens are replayed into it) and dropped when the scheduler says it finished.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mlxserve.core.request import Logprobs, Request
from mlxserve.structured_output.grammar import GrammarState
from mlxserve.worker.sampler import SamplingState


@dataclass
class RequestState:
    """What the runner keeps per live request between steps."""

    sampling: SamplingState
    grammar: GrammarState | None = None  # structured outputs: where the output is in it
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    # Set once the whole prompt is scored: a preempted request recomputes its prompt,
    # but its prompt logprobs are not computed (or reported) twice.
    prompt_logprobs_done: bool = False


class RequestStates:
    """The live requests' states by request id; a request without a seed draws one here."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._states: dict[str, RequestState] = {}

    def __getitem__(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def __len__(self) -> int:
        return len(self._states)

    def drop(self, request_id: str) -> None:
        """Forget a finished request (nothing happens if it has no state)."""
        self._states.pop(request_id, None)

    def clear(self) -> None:
        """Forget every request (their states are remade from their tokens when next run)."""
        self._states.clear()

    def get(self, request: Request) -> RequestState:
        """The request's state, made (and its output tokens replayed) if it has none."""
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
            state = RequestState(sampling, grammar)
            self._states[request.request_id] = state
        return state
