"""AttentionMetadata: where each token of a flat batch lives in the block pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step layout of a varlen batch, shared by every layer.

    Tokens of all requests are laid out on one flat axis, decodes first::

        tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |   (d = decode, p = prefill chunk)
        query_start_loc: [0, 1, 2, 3, 7, 9]

    Request i's new tokens sit at positions ``context_lens[i] - query_lens[i] ..
    context_lens[i] - 1`` of its sequence; everything before them is already in the
    block pool. Padding tokens (bucketed shapes) write to the null block 0.
    """

    slot_mapping: mx.array  # (num_tokens,) int32: block_id * block_size + offset
    query_start_loc: mx.array  # (num_reqs + 1,) int32
    context_lens: mx.array  # (num_reqs,) int32: cached + new tokens after this step
    block_tables: mx.array  # (num_reqs, max_blocks) int32, padded with 0 (null block)
    # Host copies, so ops never need .item() on device arrays.
    num_decodes: int  # requests [0, num_decodes) each have exactly one query token
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    # Runs of consecutive decode rows that share one block table at consecutive context
    # lengths (a speculative verification: one request's rows), their sizes in order;
    # () = every decode row alone. The fallback gathers such a run's keys once.
    decode_group_sizes: tuple[int, ...] = ()
    # Arrays derived from these once per step and shared by every layer (the decode
    # attention's block tables and mask, see ops/fallback.py), by what they depend on.
    derived: dict[tuple, tuple[mx.array, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_decode_context_len(self) -> int:
        return max(self.context_lens_host[: self.num_decodes], default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_tokens_padded: int | None = None,
        num_blocks_padded: int | None = None,
    ) -> AttentionMetadata:
        """Make metadata from host lists (tests and the runner).

        ``query_lens`` must put one-token (decode) requests first. Positions of new
        tokens follow from ``context_lens``; slots from the block tables.
        """
        import numpy as np

        num_reqs = len(query_lens)
        assert len(context_lens) == num_reqs == len(block_tables)
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        assert all(q >= 1 for q in query_lens)
        num_tokens = sum(query_lens)
        padded = max(num_tokens_padded or num_tokens, num_tokens)
        slots = np.zeros(padded, dtype=np.int32)
        t = 0
        for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
            assert c >= q and len(table) * block_size >= c, (q, c, len(table))
            pos = np.arange(c - q, c)
            blocks = np.asarray(table, dtype=np.int64)[pos // block_size]
            slots[t : t + q] = blocks * block_size + pos % block_size
            t += q
        width = max(num_blocks_padded or 0, max((len(b) for b in block_tables), default=0), 1)
        tables = np.zeros((num_reqs, width), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(query_lens)
        groups = _decode_groups(context_lens[:num_decodes], block_tables[:num_decodes])
        return cls(
            slot_mapping=mx.array(slots),
            query_start_loc=mx.array(qsl),
            context_lens=mx.array(np.asarray(context_lens, dtype=np.int32)),
            block_tables=mx.array(tables),
            num_decodes=num_decodes,
            query_lens=tuple(int(q) for q in query_lens),
            context_lens_host=tuple(int(c) for c in context_lens),
            decode_group_sizes=groups if any(n > 1 for n in groups) else (),
        )

    def positions(self) -> list[int]:
        """Sequence position of every (unpadded) token, on the host."""
        out: list[int] = []
        for q, c in zip(self.query_lens, self.context_lens_host, strict=True):
            out.extend(range(c - q, c))
        return out


def _decode_groups(context_lens: list[int], block_tables: list[list[int]]) -> tuple[int, ...]:
    """Sizes of the runs of decode rows with the same table and context lengths c, c+1, ..."""
    sizes: list[int] = []
    for i, (ctx, table) in enumerate(zip(context_lens, block_tables, strict=True)):
        prev = i - 1
        if (
            sizes
            and context_lens[prev] + 1 == ctx
            and (block_tables[prev] is table or list(block_tables[prev]) == list(table))
        ):
            sizes[-1] += 1
        else:
            sizes.append(1)
    return tuple(sizes)


@dataclass(frozen=True)
class StateMetadata:
    """Where each request's recurrent state is read from and written to in one step.

    Per request (batch order, as AttentionMetadata): the state slot its step starts from
    (slot 0 holds zeros: a fresh prefix) and the one its final state goes to. A snapshot
    ``(request index, offset, slot)`` also writes the state after the first ``offset`` new
    tokens of that request into ``slot`` (prefix caching). ``write_order`` is every written
    slot: the final states in batch order, then the snapshots in order.
    """

    read_slots: mx.array  # (num_reqs,) int32
    write_order: mx.array  # (num_reqs + num_snapshots,) int32
    snapshots: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(
        cls,
        read_slots: list[int],
        write_slots: list[int],
        snapshots: list[tuple[int, int, int]] | tuple[tuple[int, int, int], ...] = (),
    ) -> StateMetadata:
        """Make metadata from host lists (the runner, tests)."""
        assert len(read_slots) == len(write_slots)
        written = list(write_slots) + [slot for _, _, slot in snapshots]
        assert 0 not in written and len(set(written)) == len(written), written
        return cls(
            read_slots=mx.array(read_slots, dtype=mx.int32),
            write_order=mx.array(written, dtype=mx.int32),
            snapshots=tuple(snapshots),
        )
