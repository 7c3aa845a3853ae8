"""n > 1: one user request fanned out into n engine requests, and gathered back.

    user request "a", n=3  ->  engine requests "a", "a#1", "a#2"   (sample index 0, 1, 2)

Sample 0 is scheduled at once; the others are held until it has prefilled, so they find
its prompt blocks in the prefix cache instead of computing the prompt again. Engine ids
are reserved when the user request is added: "a#1" cannot be added while "a" (n >= 2)
is live, nor "a" with n >= 2 while "a#1" is.
"""

from __future__ import annotations

import copy

from mlxserve.core.request import Request
from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import SamplingParams
from mlxserve.structured_output.grammar import StructuredOutputRequest


def child_request_id(request_id: str, index: int) -> str:
    """Engine id of sample ``index`` of a user request (the first keeps the user's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class ParentRequest:
    """One user request's n samples: their engine ids and params, and the held samples."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        # Samples 1..n-1, waiting for sample 0's prompt blocks to be cached.
        self.held: list[Request] = []

    def child_params(self, index: int) -> SamplingParams:
        """Sample ``index``'s params: a seeded request gives each sample its own seed."""
        if self.params.n == 1 or self.params.seed is None:
            return self.params
        params = copy.copy(self.params)
        params.seed = self.params.seed + index
        return params

    def make_requests(
        self,
        prompt_token_ids: list[int],
        eos_token_ids: frozenset[int],
        max_tokens: int,
        arrival_time: float,
        structured_output: StructuredOutputRequest | None = None,
    ) -> Request:
        """The engine requests of every sample; returns sample 0's, holds the others.

        Each sample gets its own grammar state (in the runner) from the one compiled grammar.
        """
        requests = [
            Request(
                cid,
                prompt_token_ids,
                self.child_params(i),
                eos_token_ids,
                max_tokens,
                arrival_time,
                structured_output=structured_output,
            )
            for i, cid in enumerate(self.child_ids)
        ]
        self.held = requests[1:]
        return requests[0]


class ParallelSampling:
    """Every live user request's fan-out: engine id <-> (user request, sample index)."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self._owners: dict[str, tuple[ParentRequest, int]] = {}  # engine id -> owner

    def add(self, request_id: str, params: SamplingParams) -> ParentRequest:
        """Reserve the engine ids of a new user request; ParameterError if one is taken."""
        parent = ParentRequest(request_id, params)
        for cid in parent.child_ids:
            owner = self._owners.get(cid)
            if owner is None:
                continue
            if cid == request_id:
                message = f"request_id {request_id!r} is already in use"
            else:
                message = (
                    f"request_id {request_id!r} with n={params.n} needs engine id {cid!r}, "
                    "which is already in use"
                )
            holder, index = owner[0].request_id, owner[1]
            if holder != cid:
                message += f" (sample {index} of request {holder!r})"
            raise ParameterError(message, parameter="request_id")
        self.parents[request_id] = parent
        for i, cid in enumerate(parent.child_ids):
            self._owners[cid] = (parent, i)
        return parent

    def owner(self, engine_id: str) -> tuple[ParentRequest, int]:
        """(user request, sample index) of a live engine request."""
        return self._owners[engine_id]

    def parent_of(self, engine_id: str) -> ParentRequest | None:
        """The live user request an engine request belongs to, if any."""
        owner = self._owners.get(engine_id)
        return None if owner is None else owner[0]

    def get(self, request_id: str) -> ParentRequest | None:
        return self.parents.get(request_id)

    def remove(self, request_id: str) -> None:
        """Forget a user request; its engine ids become free."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for cid in parent.child_ids:
                self._owners.pop(cid, None)

    def release_held(self, engine_id: str) -> list[Request]:
        """The held samples to schedule now that ``engine_id`` (a sample 0) has prefilled."""
        parent, index = self._owners.get(engine_id, (None, -1))
        if parent is None or index != 0 or not parent.held:
            return []
        held, parent.held = parent.held, []
        return held

    def has_held(self) -> bool:
        """True while any user request has samples waiting to be scheduled."""
        return any(p.held for p in self.parents.values())
