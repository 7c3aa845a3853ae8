"""Sizing the KV block pool from the memory MLX may use.

budget      = memory_fraction x usable memory (Metal working set, or system RAM on CPU)
kv_budget   = budget - weights - activation peak (probed, scaled to the token budget),
              or kv_cache_memory_bytes when given (vLLM's --kv-cache-memory-bytes)
num_blocks  = kv_budget / bytes per block, never more than max_model_len x max_num_seqs needs
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import mlx.core as mx

from mlxserve.ops import AttentionMetadata
from mlxserve.utils import GiB, cdiv, usable_memory

logger = logging.getLogger("mlxserve")

# Below this many tokens of KV a server is not useful; the error then names the knobs.
MIN_KV_TOKENS = 256
# Tokens in the start-up probe that measures activation memory per token (small: on
# the CPU backend a forward pass costs ~0.1 s per token of a 135M model).
PROBE_TOKENS = 8


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.size


@dataclass(frozen=True)
class KVPlan:
    """The pool size and context length an engine starts with, and why."""

    num_blocks: int  # including the null block
    block_size: int
    max_model_len: int
    kv_bytes: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def describe(self, max_num_seqs: int) -> str:
        concurrency = self.num_tokens / self.max_model_len
        return (
            f"KV cache: up to {self.num_blocks - 1} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens ({self.kv_bytes / GiB:.2f} GiB, "
            f"{self.bytes_per_token // 1024} KiB/token, allocated as used); "
            f"max_model_len {self.max_model_len}; "
            f"max concurrency at max_model_len: {concurrency:.1f}x "
            f"(max_num_seqs {max_num_seqs})"
        )


def plan_kv_cache(
    *,
    bytes_per_token: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    max_num_seqs: int,
    memory_fraction: float,
    weights_bytes: int,
    activation_bytes: int,
    num_blocks: int | None = None,
    total_memory: int | None = None,
    kv_cache_memory_bytes: int | None = None,
) -> KVPlan:
    """Choose num_blocks and max_model_len, or raise ValueError naming the knob to turn."""
    if max_model_len is not None and max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {max_model_len} is larger than the model's context length "
            f"{model_max_len}"
        )
    bytes_per_block = bytes_per_token * block_size
    if num_blocks is not None:  # explicit pool size (tests, experts)
        tokens = (num_blocks - 1) * block_size
        length = max_model_len or min(model_max_len, tokens)
        if length > tokens:
            raise ValueError(
                f"num_blocks {num_blocks} holds {tokens} tokens, fewer than max_model_len "
                f"{length}; use num_blocks >= {cdiv(length, block_size) + 1}"
            )
        return KVPlan(
            num_blocks, block_size, length, (num_blocks - 1) * bytes_per_block, bytes_per_token
        )
    need_min = MIN_KV_TOKENS if max_model_len is None else max(max_model_len, 1)
    if kv_cache_memory_bytes is not None:  # an explicit budget, as vLLM's knob
        kv_budget = kv_cache_memory_bytes
        if kv_budget < need_min * bytes_per_token:
            raise ValueError(
                f"kv_cache_memory_bytes (--kv-cache-memory-bytes, $VLLM_CPU_KVCACHE_SPACE) "
                f"{kv_budget} holds {kv_budget // bytes_per_token} tokens of KV "
                f"({bytes_per_token} bytes each), fewer than {need_min}; use at least "
                f"{need_min * bytes_per_token}"
            )
        return _plan(
            kv_budget, bytes_per_token, block_size, model_max_len, max_model_len, max_num_seqs
        )
    total = total_memory if total_memory is not None else usable_memory()
    budget = int(total * memory_fraction)
    kv_budget = budget - weights_bytes - activation_bytes
    if kv_budget < need_min * bytes_per_token:
        # Rounded up, so the suggested value really fits.
        fits = (
            math.ceil(100 * (weights_bytes + activation_bytes + need_min * bytes_per_token) / total)
            / 100
        )
        raise ValueError(
            f"not enough memory for the KV cache: memory_fraction (--gpu-memory-utilization) "
            f"{memory_fraction} of {total / GiB:.1f} GiB is {budget / GiB:.2f} GiB, but the "
            f"weights take {weights_bytes / GiB:.2f} GiB and activations "
            f"{activation_bytes / GiB:.2f} GiB, leaving room for "
            f"{max(kv_budget, 0) // bytes_per_token} tokens of KV (need {need_min}). "
            + (f"Use memory_fraction >= {fits:.2f}" if fits <= 1 else "Use a smaller model")
            + (", or a smaller max_model_len (--max-model-len)" if max_model_len else "")
        )
    return _plan(kv_budget, bytes_per_token, block_size, model_max_len, max_model_len, max_num_seqs)


def _plan(
    kv_budget: int,
    bytes_per_token: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    max_num_seqs: int,
) -> KVPlan:
    """Blocks and context length from a KV budget already known to hold the minimum."""
    bytes_per_block = bytes_per_token * block_size
    tokens = kv_budget // bytes_per_token
    if max_model_len is None:
        length = min(model_max_len, tokens)  # capped so one full request fits
        if length < model_max_len:
            logger.warning(
                "max_model_len capped at %d (model supports %d) to fit the KV cache; raise "
                "--gpu-memory-utilization (or --kv-cache-memory-bytes) for longer contexts",
                length,
                model_max_len,
            )
    else:
        length = max_model_len
    # No more blocks than max_num_seqs full-length requests can use.
    useful = cdiv(length * max_num_seqs, block_size)
    blocks = min(tokens // block_size, useful) + 1  # + the null block
    return KVPlan(blocks, block_size, length, (blocks - 1) * bytes_per_block, bytes_per_token)


def probe_activation_bytes(model, allocate, block_size: int, num_tokens: int) -> float:
    """Peak memory of a forward pass per token, measured on a ``num_tokens``-token prompt.

    ``allocate(num_blocks)`` makes a K/V pool for ``model``; it is dropped afterwards.
    """
    n = num_tokens
    num_blocks = cdiv(n, block_size) + 1
    cache = allocate(num_blocks)
    md = AttentionMetadata.build([n], [n], [list(range(1, num_blocks))], block_size)
    mx.eval(cache.keys, cache.values)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    logits = model(
        mx.zeros((n,), mx.int32),
        mx.arange(n, dtype=mx.int32),
        md,
        cache,
        logits_indices=mx.array([n - 1], dtype=mx.int32),
    )
    mx.eval(logits)
    per_token = max(mx.get_peak_memory() - base, 0) / n
    del cache, logits
    mx.clear_cache()
    return per_token


def tree_bytes(params) -> int:
    """Total bytes of the arrays in a (nested) parameter tree."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(params))
