"""The KV cache layout's share of a step's inputs: block tables per group, state slots.

A model adapted from mlx-lm gets one AttentionMetadata per KV cache group (each group's
block tables; the flat layout is the same in all) and a StateMetadata for its recurrent
layers; a hand-written model gets the one group's AttentionMetadata only.
"""

from __future__ import annotations

from mlxserve.core.scheduler import SchedulerOutput
from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.ops import AttentionMetadata, StateMetadata


def step_metadata(
    layout: KVCacheLayout,
    so: SchedulerOutput,
    query_lens: list[int],
    context_lens: list[int],
    tables: list[tuple[list[int], ...]],
    block_size: int,
    takes_layout: bool,
) -> tuple[AttentionMetadata, dict[str, object]]:
    """(the step's AttentionMetadata, the model's extra keyword arguments); ``tables``:
    each query_lens entry's block table in every group."""
    group_mds = tuple(
        AttentionMetadata.build(query_lens, context_lens, [t[g] for t in tables], block_size)
        for g in range(layout.num_groups)
    )
    if group_mds:
        md = group_mds[0]
    else:  # recurrent layers only: no blocks, every token on the null block
        null_tables = [[0] * -(-c // block_size) for c in context_lens]
        md = AttentionMetadata.build(query_lens, context_lens, null_tables, block_size)
    if not takes_layout:
        return md, {}
    return md, {"group_metadata": group_mds, "state_metadata": state_metadata(layout, so)}


def state_metadata(layout: KVCacheLayout, so: SchedulerOutput) -> StateMetadata | None:
    """Each request's state slots (recurrent layers), in batch order."""
    if not layout.has_state:
        return None
    reads, writes, snapshots = [], [], []
    for i, req in enumerate(so.scheduled_requests):
        slots = so.state_slots[req.request_id]
        reads.append(slots.read)
        writes.append(slots.write)
        start = so.start_positions[req.request_id]
        snapshots += [(i, position - start, slot) for position, slot in slots.snapshots]
    return StateMetadata.build(reads, writes, snapshots)


def probe_arguments(layout: KVCacheLayout, md: AttentionMetadata) -> dict[str, object]:
    """A one-request probe's layout arguments: every group on its table, state slot 1."""
    state = StateMetadata.build([0], [1]) if layout.has_state else None
    return {"group_metadata": (md,) * layout.num_groups, "state_metadata": state}
