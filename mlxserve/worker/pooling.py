"""Embedding requests in the runner: which rows' hidden states they need, and their sums.

A prompt is computed in chunks (one per step), so mean pooling keeps a running sum per
request on the host and divides once the last chunk is in; last-token pooling needs only
the row of the prompt's last token, in the step that computes it::

    step rows:  | d0 | p1 p1 p1 p1 | e2 e2 e2 e2 e2 |      e = a chunk of an embedding prompt
    hidden rows (mean):            ^^ ^^ ^^ ^^ ^^   summed on the device, added on the host
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxserve.core.request import Request


@dataclass
class PoolingRows:
    """One step's embedding requests: their rows in the batch and what each chunk is."""

    rows: list[int] = field(default_factory=list)  # batch rows whose hidden states are needed
    spans: list[tuple[int, int]] = field(default_factory=list)  # per request: (first, count)
    # (request, its chunk starts the prompt or replaces the sum, its chunk ends the prompt)
    requests: list[tuple[Request, bool, bool]] = field(default_factory=list)

    def add(self, request: Request, row0: int, start: int, n: int, done: bool) -> None:
        """Note a request's chunk: batch rows row0 .. row0 + n - 1, prompt positions from start."""
        if request.pooling == "mean":
            self.spans.append((len(self.rows), n))
            self.rows.extend(range(row0, row0 + n))
            self.requests.append((request, start == 0, done))
        elif done:  # "last": only the prompt's last token matters
            self.spans.append((len(self.rows), 1))
            self.rows.append(row0 + n - 1)
            self.requests.append((request, True, done))

    def reduce(
        self,
        hidden: mx.array,  # (len(rows), hidden)
    ) -> mx.array:  # (len(requests), hidden) float32
        """Per request, the sum of its rows' hidden states (one row for "last")."""
        hidden = hidden.astype(mx.float32)
        return mx.stack([hidden[a : a + k].sum(axis=0) for a, k in self.spans])


class PoolingSums:
    """Running sums of mean-pooled requests between steps (host side)."""

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}

    def drop(self, request_id: str) -> None:
        self._sums.pop(request_id, None)

    def add(self, request: Request, first: bool, done: bool, row: np.ndarray) -> list[float] | None:
        """Fold a chunk's sum in; the pooled vector once the prompt is done, else None."""
        rid = request.request_id
        # A chunk from position 0 starts afresh (a preempted request recomputes its prompt).
        total = row if first else self._sums[rid] + row
        if not done:
            self._sums[rid] = total
            return None
        self._sums.pop(rid, None)
        if request.pooling == "mean":
            total = total / request.num_prompt_tokens
        return total.tolist()
