"""The single dispatch point for attention kernels.

``write_kv`` and ``paged_attention`` pick an implementation once per process:
Metal kernels when they can run, else the pure-MLX fallback. Set
``MLXSERVE_KERNELS=auto|metal|fallback`` to override; ``kernel_backend()`` says
which one is in use and why.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from mlxserve.ops import fallback
from mlxserve.ops.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "kernel_backend", "paged_attention", "write_kv"]

KERNEL_CHOICES = ("auto", "metal", "fallback")


@lru_cache(maxsize=1)
def kernel_backend() -> tuple[str, str]:
    """(backend, reason): which implementation the ops use, and why."""
    choice = os.environ.get("MLXSERVE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"MLXSERVE_KERNELS must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}"
        )
    if choice == "fallback":
        return "fallback", "MLXSERVE_KERNELS=fallback"
    metal_ok = mx.metal.is_available()
    if choice == "metal":
        raise RuntimeError(
            "MLXSERVE_KERNELS=metal, but mlxserve's Metal kernels are not available: "
            + (
                "this build has none yet"
                if metal_ok
                else "mx.metal.is_available() is False "
                "(no Metal device; MLX runs on its CPU backend here)"
            )
        )
    if not metal_ok:
        return "fallback", "Metal is not available (mx.metal.is_available() is False)"
    return "fallback", "no Metal kernels are built into this version"


def write_kv(
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: mx.array,
    keys: mx.array,  # (num_tokens, num_kv_heads, head_dim)
    values: mx.array,
    slot_mapping: mx.array,  # (num_tokens,) int32
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V rows into the pool; returns the updated (k_cache, v_cache)."""
    return fallback.write_kv(k_cache, v_cache, keys, values, slot_mapping)


def paged_attention(
    q: mx.array,  # (num_tokens, num_heads, head_dim)
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: mx.array,
    md: AttentionMetadata,
    scale: float,
) -> mx.array:  # (num_tokens, num_heads, head_dim)
    """Attention of each new token over its request's context in the block pool."""
    return fallback.paged_attention(q, k_cache, v_cache, md, scale)
