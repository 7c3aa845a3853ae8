"""What the runner asks of a model, written down as Protocols (checked with isinstance).

Every model (a file in models/, the mlx-lm adapter, a tensor- or pipeline-parallel shard)
is a :class:`Model`, and either a :class:`UniformModel` (every attention layer's pool has
one shape: the hand-written architectures) or a :class:`LayoutModel` (it gives its KV cache
layout: the mlx-lm adapter). The other capabilities below are separate Protocols so that the
runner asks ``isinstance(model, LayoutModel)`` instead of probing attribute names: a model
has a capability exactly when it has every member of its Protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.ops import AttentionMetadata

__all__ = [
    "LayerShapesModel",
    "LayoutModel",
    "Model",
    "PipelineStageModel",
    "ShardedModel",
    "UniformModel",
]


@runtime_checkable
class Model(Protocol):
    """Every model: a forward over a flat token axis on the paged KV cache.

    ``model(input_ids, positions, attn_metadata, kv_cache, logits_indices)`` returns the
    logits of the rows ``logits_indices`` picks (all rows when None).
    """

    vocab_size: int
    num_layers: int

    def __call__(
        self,
        input_ids: mx.array,  # (num_tokens,) int32
        positions: mx.array,  # (num_tokens,) int32
        attn_metadata: AttentionMetadata,
        kv_cache: Any,  # models.base.KVCache
        logits_indices: mx.array | None = None,  # (num_rows,) int32
        **kwargs: Any,
    ) -> Any: ...


@runtime_checkable
class UniformModel(Model, Protocol):
    """A model whose KV pools are ``num_layers`` x (``num_kv_heads``, ``head_dim``) (unless it
    is also a :class:`LayerShapesModel`), all read through one block table."""

    num_kv_heads: int
    head_dim: int


@runtime_checkable
class LayoutModel(Protocol):
    """A model whose layers differ in cache kind (the mlx-lm adapter): it gives its KV cache
    layout, and its forward takes ``group_metadata`` (one AttentionMetadata per KV cache
    group) and ``state_metadata`` (recurrent layers' state slots)."""

    @property
    def kv_cache_layout(self) -> KVCacheLayout: ...


@runtime_checkable
class LayerShapesModel(Protocol):
    """A model whose attention layers' pools differ in shape: (num_kv_heads, k_dim, v_dim)
    per layer."""

    kv_layer_shapes: Sequence[tuple[int, int, int]]


@runtime_checkable
class PipelineStageModel(Protocol):
    """A pipeline-parallel rank's stage (models/pipeline_parallel.py): the group of stages,
    and how many pool writes a step with these query lengths makes on this rank."""

    @property
    def pp_group(self) -> mx.distributed.Group: ...

    def pool_writes(self, query_lens: list[int]) -> int: ...


@runtime_checkable
class ShardedModel(Protocol):
    """A tensor-parallel shard (models/tensor_parallel.py): the group it is split over."""

    tp_group: mx.distributed.Group
