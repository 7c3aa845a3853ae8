"""KV blocks between the pool and the host: read whole blocks out (to keep them on disk) and
write them back into pool blocks (a prefix found on disk), every K/V array of the layout.

A block's bytes leave and return exactly: bfloat16 travels as its uint16 bits (NumPy has no
bfloat16), int8 pools with their per-row scales (ops/kv_quant.py) as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxserve.models.base import KVCache


@dataclass(frozen=True)
class StoredBlock:
    """One block's K/V on the host: every pool array's slice, in the pool's order (keys,
    then values), with each array's MLX dtype name."""

    arrays: tuple[np.ndarray, ...]
    dtypes: tuple[str, ...]


def read_blocks(cache: KVCache, block_ids: list[int]) -> list[StoredBlock]:
    """Copies of pool blocks ``block_ids`` (evaluates the pools: call it with no step in
    flight, or it waits for that step)."""
    if not block_ids:
        return []
    index = mx.array(block_ids, dtype=mx.int32)
    pools = [arrays[i] for arrays, i in _slots(cache)]
    gathered = [pool[index] for pool in pools]
    mx.eval(gathered)
    dtypes = tuple(str(pool.dtype).rsplit(".", 1)[-1] for pool in pools)
    host = [
        np.array(g.view(mx.uint16) if g.dtype == mx.bfloat16 else g, copy=False) for g in gathered
    ]
    return [StoredBlock(tuple(a[i] for a in host), dtypes) for i in range(len(block_ids))]


def write_blocks(cache: KVCache, loads: list[tuple[int, StoredBlock]]) -> None:
    """Put each stored block into its pool block (lazy: it happens with the next step)."""
    if not loads:
        return
    index = mx.array([block_id for block_id, _ in loads], dtype=mx.int32)
    for j, (arrays, i) in enumerate(_slots(cache)):
        data = mx.array(np.stack([stored.arrays[j] for _, stored in loads]))
        if loads[0][1].dtypes[j] == "bfloat16":
            data = data.view(mx.bfloat16)
        arrays[i][index] = data


def _slots(cache: KVCache) -> list[tuple[list[mx.array], int]]:
    """(list, index) of every pool array: keys, then values (a stored block's order)."""
    return [(cache.keys, i) for i in range(len(cache.keys))] + [
        (cache.values, i) for i in range(len(cache.values))
    ]
