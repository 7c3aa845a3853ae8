"""The SPMD step protocol: rank 0 sends each forward pass's inputs, every rank runs it.

Rank 0 runs the scheduler and samples; the other ranks hold a ModelRunner with their
shard of the weights (tensor parallel) or their layers (pipeline parallel:
worker/pipeline.py) and of the KV pool, and run a loop (:func:`serve_forwards`)::

    rank 0:  schedule -> ForwardInputs -> broadcast -> forward (all_sum per block) -> sample
    rank r:              receive ------------------> forward (all_sum per block) -> (drop)

A message is two ``mx.distributed.all_sum`` of int32 buffers (rank 0 holds the data, the
others zeros, so the sum is rank 0's data on every rank): a fixed header (kind, payload
length) and the payload. Integers sum exactly, and all_sum is the one collective every
backend (ring, JACCL, MPI) has. The payload is what the forward needs and nothing else:
token ids, the batch's query/context lengths and block tables (positions and slot mapping
follow from them), the rows whose logits are needed, and the pool size to grow to.
Sampling parameters never travel: only rank 0 samples, and the next step's token ids come
from rank 0. Aborts, finishes and preemption are scheduler state on rank 0, seen by the
other ranks as the next forwards' block tables; shutdown is a STOP message. A STATS
message asks every rank for its counters (one row each, in one all_sum).

Every forward rank 0 runs goes through :meth:`StepChannel.send` first, including the
start-up memory probe and the re-runs that isolate a failing request, so the ranks'
collectives always pair up. A rank that dies closes its sockets: the ring backend then
fails the pending collective on the others ("connection to a peer was lost"), which
surfaces as :class:`RankLostError` (no per-request isolation: the group is gone).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxserve.ops import AttentionMetadata

FORWARD, STOP, STATS = 1, 2, 3
HEADER_LEN = 4  # kind, payload length, and room to grow
# A rank's sockets close while it exits, so a collective can fail a moment before the
# process can be reaped: how long to wait for that, to name the rank and how it ended.
EXIT_GRACE_SECONDS = 1.0
NUM_STATS = 12  # counters per rank in a STATS reply (room to grow)


class RankLostError(RuntimeError):
    """A tensor- or pipeline-parallel rank is gone (it exited, broke its connection, or
    stopped responding and was stopped)."""


@dataclass(frozen=True)
class ForwardInputs:
    """Everything a rank needs to run one forward pass, as host lists."""

    num_blocks: int  # the KV pool holds at least this many blocks for this forward
    input_ids: list[int]  # (num_tokens,)
    query_lens: list[int]  # (num_reqs,) decodes first
    context_lens: list[int]  # (num_reqs,)
    block_tables: list[list[int]]  # (num_reqs, blocks of that request)
    logits_rows: list[int]  # rows whose logits are needed ([] -> every row)
    num_hidden_rows: int = 0  # the last that many rows are wanted as hidden states

    def positions(self) -> list[int]:
        """Each new token's position: request i's are context - query .. context - 1."""
        out: list[int] = []
        for q, c in zip(self.query_lens, self.context_lens, strict=True):
            out.extend(range(c - q, c))
        return out

    def metadata(self, block_size: int) -> AttentionMetadata:
        return AttentionMetadata.build(
            self.query_lens, self.context_lens, self.block_tables, block_size
        )

    def pack(self) -> np.ndarray:  # (payload,) int32
        """One int32 buffer: counts first, then the lists."""
        tables = self.block_tables
        parts = [
            [
                self.num_blocks,
                len(self.input_ids),
                len(self.query_lens),
                len(self.logits_rows),
                self.num_hidden_rows,
            ],
            self.input_ids,
            self.query_lens,
            self.context_lens,
            [len(t) for t in tables],
            [b for t in tables for b in t],
            self.logits_rows,
        ]
        return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])

    @classmethod
    def unpack(cls, buf: np.ndarray) -> ForwardInputs:
        values = buf.tolist()
        num_blocks, num_tokens, num_reqs, num_rows, num_hidden_rows = values[:5]
        at = 5

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return values[at - n : at]

        input_ids = take(num_tokens)
        query_lens = take(num_reqs)
        context_lens = take(num_reqs)
        table_lens = take(num_reqs)
        tables = [take(n) for n in table_lens]
        rows = take(num_rows)
        return cls(num_blocks, input_ids, query_lens, context_lens, tables, rows, num_hidden_rows)


class StepChannel:
    """Rank 0 -> every rank, over ``group``'s all_sum; counts bytes and seconds sent."""

    def __init__(
        self,
        group: mx.distributed.Group,
        is_lost: Callable[[], str | None],
        name: str = "tensor parallel",
    ) -> None:
        self.group = group
        self.name = name  # in error messages
        self.rank = group.rank()
        self.size = group.size()
        # Why the group is broken (a rank's exit code), or None; checked after an error.
        self._is_lost = is_lost
        self.num_messages = 0
        self.num_bytes = 0
        self.seconds = 0.0

    def _all_sum(self, buf: np.ndarray) -> np.ndarray:
        if self.rank != 0:
            buf = np.zeros_like(buf)
        try:
            out = mx.distributed.all_sum(mx.array(buf), group=self.group)
            mx.eval(out)
        except RuntimeError as e:
            raise self.lost(e) from None
        return np.array(out)

    def lost(self, error: BaseException) -> RankLostError:
        """The RankLostError for ``error`` raised by a collective (naming the rank that
        exited, if one does within EXIT_GRACE_SECONDS)."""
        why = self._is_lost()
        deadline = time.monotonic() + EXIT_GRACE_SECONDS
        while why is None and time.monotonic() < deadline:
            time.sleep(0.02)
            why = self._is_lost()
        why = why or str(error)
        return RankLostError(f"{self.name}: a rank is gone ({why}); the engine stops")

    def check(self, error: BaseException) -> None:
        """Raise RankLostError if ``error`` (from a step) means the group is broken."""
        if isinstance(error, RankLostError):
            raise error
        if "[ring]" in str(error) or self._is_lost() is not None:
            raise self.lost(error) from None

    def _send(self, kind: int, payload: np.ndarray) -> None:
        t0 = time.perf_counter()
        header = np.zeros(HEADER_LEN, dtype=np.int32)
        header[:2] = kind, payload.size
        self._all_sum(header)
        if payload.size:
            self._all_sum(payload)
        self.seconds += time.perf_counter() - t0
        self.num_messages += 1
        self.num_bytes += (HEADER_LEN + payload.size) * 4

    def send(self, inputs: ForwardInputs) -> None:
        """Rank 0: tell every rank to run this forward."""
        self._send(FORWARD, inputs.pack())

    def start(self, inputs: ForwardInputs, arrays: list[list[mx.array]]) -> None:
        """Rank 0: send a built forward to every rank, then start evaluating its
        ``arrays`` here, so its collectives are queued before the next message's, in the
        order every rank runs them."""
        self.send(inputs)
        try:
            mx.async_eval(arrays)
        except RuntimeError as e:
            raise self.lost(e) from None

    def stop(self) -> None:
        """Rank 0: tell every rank to leave its loop."""
        self._send(STOP, np.zeros(0, dtype=np.int32))

    def gather_stats(self, mine: list[float]) -> list[list[float]]:
        """Rank 0: every rank's counters (``mine`` for rank 0), one row per rank."""
        self._send(STATS, np.zeros(0, dtype=np.int32))
        return self._stats_all_sum(mine)

    def _stats_all_sum(self, mine: list[float]) -> list[list[float]]:
        # Each rank fills its own row; float32 is exact enough for seconds and counts.
        rows = np.zeros((self.size, NUM_STATS), dtype=np.float32)
        rows[self.rank, : len(mine)] = mine
        try:
            out = mx.distributed.all_sum(mx.array(rows), group=self.group)
            mx.eval(out)
        except RuntimeError as e:
            raise self.lost(e) from None
        return np.array(out).tolist()

    def receive(self, stats: Callable[[], list[float]] | None = None) -> ForwardInputs | None:
        """Rank r > 0: the next forward's inputs, or None on STOP; answers STATS
        requests with ``stats()`` on the way."""
        while True:
            header = self._all_sum(np.zeros(HEADER_LEN, dtype=np.int32))
            kind, length = int(header[0]), int(header[1])
            if kind == STOP:
                return None
            if kind == STATS:
                self._stats_all_sum(stats() if stats is not None else [])
                continue
            assert kind == FORWARD, header
            return ForwardInputs.unpack(self._all_sum(np.zeros(length, dtype=np.int32)))


def serve_forwards(
    run: Callable[[ForwardInputs], None],
    channel: StepChannel,
    stats: Callable[[], list[float]] | None = None,
) -> int:
    """Rank r > 0: run every forward rank 0 sends until STOP; how many ran. ``stats()``
    answers rank 0's :meth:`StepChannel.gather_stats`.

    RankLostError if rank 0 (or another rank) is gone.
    """
    count = 0
    while (inputs := channel.receive(stats)) is not None:
        try:
            run(inputs)
        except Exception as e:  # noqa: BLE001 -- a lost peer ends the loop, the rest is a bug
            channel.check(e)
            raise
        count += 1
    return count
