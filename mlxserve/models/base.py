"""Pieces every architecture shares: config parsing, the KV block pool, paged attention.

The shared layers (RMSNorm, rotary embeddings) are in models/layers.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve import ops
from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.models.contract import LayerShapesModel
from mlxserve.ops import AttentionMetadata, kv_quant


@dataclass
class BaseModelArgs:
    """Base of every ModelArgs: built from an HF config.json dict."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]):
        """Take the keys this dataclass knows, ignore the rest; missing required keys raise."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if config.get(name) is None]
        if missing:
            raise ValueError(
                f"model config ({cls.__module__}) is missing required key(s): {', '.join(missing)}"
            )
        return cls(**{k: v for k, v in config.items() if k in names})


@dataclass
class KVCache:
    """K and V block pools ``(num_blocks, block_size, num_kv_heads, head_dim)``, one pair per
    K/V tensor (per layer, or shared by one layer of each KV cache group: see
    mlxserve/kv_cache_spec.py), and the recurrent layers' state pools.

    ``states[i]`` holds recurrent layer i's arrays (mlx-lm's ArraysCache entries), each
    ``(num_state_slots, ...)``; slot 0 stays zero (the state of an empty prefix).
    Layers replace their entries every step (``ops.write_kv`` returns the updated pool) and
    drop the old arrays, so MLX can update the buffers in place.
    """

    keys: list[mx.array]
    values: list[mx.array]
    states: list[list[mx.array]] = field(default_factory=list)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float16,
    ) -> KVCache:
        """Zeroed pools for every layer (lazy: memory is committed on first evaluation)."""
        shapes = [(num_kv_heads, head_dim, head_dim)] * num_layers
        return cls.allocate_layers(shapes, num_blocks, block_size, dtype)

    @classmethod
    def allocate_layers(
        cls,
        shapes: Sequence[tuple[int, int, int]],  # per layer: (num_kv_heads, k_dim, v_dim)
        num_blocks: int,
        block_size: int,
        dtype: mx.Dtype = mx.float16,
    ) -> KVCache:
        """Zeroed pools whose head count and K / V head sizes may differ per layer; an int8
        ``dtype`` makes 8-bit pools whose rows carry their scale (ops/kv_quant.py)."""

        def pool(h: int, dim: int) -> mx.array:
            width = kv_quant.pool_row_width(dim, dtype)
            return mx.zeros((num_blocks, block_size, h, width), dtype=dtype)

        return cls(
            keys=[pool(h, k) for h, k, _ in shapes], values=[pool(h, v) for h, _, v in shapes]
        )

    @classmethod
    def allocate_for(
        cls, model: nn.Module, num_blocks: int, block_size: int, dtype: mx.Dtype = mx.float16
    ) -> KVCache:
        """One pool per attention layer of ``model`` (every layer reads the same block
        table): its ``kv_layer_shapes`` when it has them, else ``num_layers`` x
        (``num_kv_heads``, ``head_dim``)."""
        if isinstance(model, LayerShapesModel):
            shapes = model.kv_layer_shapes
        else:
            shapes = [(model.num_kv_heads, model.head_dim, model.head_dim)] * model.num_layers
        return cls.allocate_layers(shapes, num_blocks, block_size, dtype)

    @classmethod
    def allocate_layout(
        cls,
        layout: KVCacheLayout,
        num_blocks: int,
        block_size: int,
        dtype: mx.Dtype = mx.float16,
        num_state_slots: int = 0,
    ) -> KVCache:
        """The engine's pools: one per K/V tensor of ``layout``, and ``num_state_slots``
        state slots per recurrent layer (dtypes as the layer keeps them)."""
        cache = cls.allocate_layers(layout.tensor_shapes, num_blocks, block_size, dtype)
        for i in layout.state_layers:
            spec = layout.specs[i]
            cache.states.append(
                [
                    mx.zeros((num_state_slots, *shape), dtype=getattr(mx, name))
                    for shape, name in zip(spec.state_shapes, spec.state_dtypes, strict=True)
                ]
            )
        return cache

    def ensure_num_blocks(self, num_blocks: int) -> None:
        """Grow every pool to ``num_blocks`` blocks (new blocks zeroed); never shrinks.

        Lazy like everything else: the copy happens inside the next evaluated step.
        """
        extra = num_blocks - self.num_blocks
        if extra <= 0 or not self.keys:
            return
        for pools in (self.keys, self.values):
            for i, pool in enumerate(pools):
                zeros = mx.zeros((extra, *pool.shape[1:]), dtype=pool.dtype)
                pools[i] = mx.concatenate([pool, zeros])

    def ensure_num_state_slots(self, num_slots: int) -> None:
        """Grow every state pool to ``num_slots`` slots (new ones zeroed); never shrinks."""
        for arrays in self.states:
            for i, pool in enumerate(arrays):
                extra = num_slots - pool.shape[0]
                if extra > 0:
                    zeros = mx.zeros((extra, *pool.shape[1:]), dtype=pool.dtype)
                    arrays[i] = mx.concatenate([pool, zeros])

    def arrays(self) -> list[mx.array]:
        """Every pool array (to evaluate them with a step)."""
        return [*self.keys, *self.values, *(a for arrays in self.states for a in arrays)]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def num_state_slots(self) -> int:
        return self.states[0][0].shape[0] if self.states else 0

    @property
    def block_size(self) -> int:
        return self.keys[0].shape[1]


def cached_attention(
    cache: KVCache,
    layer_idx: int,
    q: mx.array,  # (num_tokens, num_heads, head_dim)
    k: mx.array,  # (num_tokens, num_kv_heads, head_dim); CPU: or (num_tokens, 1, 1, ...)
    v: mx.array,  # (num_tokens, num_kv_heads, head_dim) (see mlxserve/cpu/ops.py)
    md: AttentionMetadata,
    scale: float,
) -> mx.array:  # (num_tokens, num_heads, head_dim)
    """Write this step's K/V into layer ``layer_idx``'s pool, then attend over the context.

    The cache's entries are replaced by the written pools before anything reads them: the
    old pools must have no holder left for the write to be in place (ops/metal.py).
    """
    keys, values = cache.keys, cache.values
    keys[layer_idx], values[layer_idx] = ops.write_kv(
        keys[layer_idx], values[layer_idx], k, v, md.slot_mapping
    )
    return ops.paged_attention(q, keys[layer_idx], values[layer_idx], md, scale)


def select_rows(
    h: mx.array,  # (num_tokens, hidden)
    logits_indices: mx.array | None,  # (num_rows,) int32
) -> mx.array:  # (num_rows or num_tokens, hidden)
    """Keep only the rows whose logits are needed, before the (large) LM head."""
    return h if logits_indices is None else h[logits_indices]


def split_hidden_rows(
    h: mx.array,  # (num_rows, hidden)
    num_hidden_rows: int,
) -> tuple[mx.array, mx.array | None]:  # (num_rows - k, hidden), (k, hidden) or None
    """Split off the last ``num_hidden_rows`` rows: those are wanted as hidden states."""
    if not num_hidden_rows:
        return h, None
    n = h.shape[0] - num_hidden_rows
    return h[:n], h[n:]


def context_limit(max_position_embeddings: int | None, sliding_window: int | None) -> int | None:
    """Longest context computed exactly: full attention equals a sliding window up to its size."""
    limits = [x for x in (max_position_embeddings, sliding_window) if x is not None]
    return min(limits) if limits else None
