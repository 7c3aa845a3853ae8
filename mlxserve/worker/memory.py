"""Sizing the KV block pool (and the recurrent-state slots) from the memory MLX may use.

budget      = memory_fraction x usable memory (Metal working set, or system RAM on CPU)
kv_budget   = budget - weights - activation peak (probed, scaled to the token budget),
              or kv_cache_memory_bytes when given (vLLM's --kv-cache-memory-bytes)
state slots = 1 (zeros) + max_num_seqs (running) + 2 x max_num_seqs (prefix snapshots),
              in at most half of kv_budget; only for models with recurrent layers
num_blocks  = what is left / bytes per block (every K/V tensor of the layout), never more
              than max_num_seqs requests of max_model_len can hold at once

A block's bytes come from the model's KVCacheLayout (mlxserve/kv_cache_spec.py): per-layer
head counts and K / V sizes, and with KV cache groups one layer of each group per tensor.
What one request holds also follows the layout: a windowed group holds its window (plus
the step's chunk), not the whole sequence.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import mlx.core as mx

from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.ops import AttentionMetadata
from mlxserve.utils import GiB, cdiv, usable_memory

logger = logging.getLogger("mlxserve")

# Below this many tokens of KV a server is not useful; the error then names the knobs.
MIN_KV_TOKENS = 256
# Tokens in the start-up probe that measures activation memory per token (small: on
# the CPU backend a forward pass costs ~0.1 s per token of a 135M model).
PROBE_TOKENS = 8
# Prefix snapshots of recurrent state per running request (its prompt end and its latest
# decode position), and the share of the KV budget state slots may take at most.
SNAPSHOTS_PER_REQUEST = 2
MAX_STATE_SHARE = 0.5


@dataclass(frozen=True)
class KVPlan:
    """The pool size, state slots and context length an engine starts with, and why."""

    num_blocks: int  # including the null block
    block_size: int
    max_model_len: int
    kv_bytes: int
    bytes_per_block: int
    layout: KVCacheLayout
    num_state_slots: int = 0  # including the null slot; 0 without recurrent layers
    state_bytes_per_slot: int = 0
    kv_dtype: str = ""  # the pool's element type: a float dtype, or "int8" (8-bit + scales)

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_bytes_per_slot

    def describe(self, max_num_seqs: int, max_num_batched_tokens: int) -> str:
        layout = self.layout
        concurrency = float("inf")
        if layout.num_groups:
            per_request = layout.blocks_per_request(
                self.max_model_len, self.block_size, max_num_batched_tokens
            )
            concurrency = (self.num_blocks - 1) / max(per_request, 1)
        if self.num_state_slots:  # one live state per running request
            concurrency = min(concurrency, self.num_state_slots - 1)
        text = f"{layout.describe()}; "
        if layout.num_groups:
            text = (
                f"KV cache: up to {self.num_blocks - 1} blocks x {self.block_size} tokens "
                f"({self.kv_dtype}, {self.kv_bytes / GiB:.2f} GiB, "
                f"{self.bytes_per_block // 1024} KiB/block, "
                f"allocated as used); " + text
            )
        if self.num_state_slots:
            text += (
                f"state: {self.num_state_slots - 1} slots x "
                f"{_size(self.state_bytes_per_slot)} ({self.state_bytes / GiB:.2f} GiB); "
            )
        return text + (
            f"max_model_len {self.max_model_len}; "
            f"max concurrency at max_model_len: {concurrency:.1f}x "
            f"(max_num_seqs {max_num_seqs})"
        )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 1024:.1f} KiB"


def max_tokens_in(layout: KVCacheLayout, blocks: int, block_size: int, chunk: int, cap: int) -> int:
    """Most tokens (up to ``cap``) one request can hold in ``blocks`` blocks."""
    low, high = 0, cap
    while low < high:
        mid = (low + high + 1) // 2
        fits = layout.blocks_per_request(mid, block_size, chunk) <= blocks
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def plan_kv_cache(
    *,
    layout: KVCacheLayout,
    dtype,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    memory_fraction: float,
    weights_bytes: int,
    activation_bytes: int,
    num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    total_memory: int | None = None,
    kv_cache_memory_bytes: int | None = None,
) -> KVPlan:
    """Choose num_blocks, state slots and max_model_len, or raise ValueError naming the
    knob to turn. ``dtype`` is the pool's dtype (anything with ``.size`` bytes; int8 means
    8-bit rows with a scale each, kv_cache_spec.kv_row_bytes)."""
    if max_model_len is not None and max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {max_model_len} is larger than the model's context length "
            f"{model_max_len}"
        )
    chunk = max_num_batched_tokens
    bytes_per_block = max(layout.bytes_per_block(block_size, dtype), 1)
    name = str(dtype).rsplit(".", 1)[-1]
    per_slot = layout.state_bytes_per_slot()
    wanted_slots = 0
    if layout.has_state:
        snapshots = SNAPSHOTS_PER_REQUEST * max_num_seqs if enable_prefix_caching else 0
        wanted_slots = 1 + max_num_seqs + snapshots

    def plan(blocks: int, length: int, slots: int) -> KVPlan:
        kv_bytes = (blocks - 1) * bytes_per_block
        return KVPlan(
            blocks, block_size, length, kv_bytes, bytes_per_block, layout, slots, per_slot, name
        )

    def blocks_for(tokens: int) -> int:
        return layout.blocks_per_request(tokens, block_size, chunk)

    if num_blocks is not None:  # explicit pool size (tests, experts)
        cap = max_tokens_in(layout, num_blocks - 1, block_size, chunk, model_max_len)
        length = max_model_len or cap
        if blocks_for(length) > num_blocks - 1:
            raise ValueError(
                f"num_blocks {num_blocks} holds {cap} tokens, fewer than max_model_len "
                f"{length}; use num_blocks >= {blocks_for(length) + 1}"
            )
        return plan(num_blocks, length, wanted_slots)
    total = total_memory if total_memory is not None else usable_memory()
    budget = int(total * memory_fraction)
    kv_budget = budget - weights_bytes - activation_bytes
    explicit = kv_cache_memory_bytes is not None  # an explicit budget, as vLLM's knob
    if explicit:
        kv_budget = kv_cache_memory_bytes
    slots = 0
    if layout.has_state:
        affordable = int(max(kv_budget, 0) * MAX_STATE_SHARE) // max(per_slot, 1)
        slots = min(wanted_slots, 1 + affordable)
        if slots < 2 and explicit:
            raise ValueError(
                f"kv_cache_memory_bytes (--kv-cache-memory-bytes, $VLLM_CPU_KVCACHE_SPACE) "
                f"{kv_cache_memory_bytes} does not hold one request's recurrent state "
                f"({per_slot / 2**20:.1f} MiB) in its half for states; use at least "
                f"{2 * 2 * per_slot}"
            )
        if slots < 2:
            raise ValueError(
                f"not enough memory for one request's recurrent state "
                f"({per_slot / 2**20:.1f} MiB): memory_fraction (--gpu-memory-utilization) "
                f"{memory_fraction} of {total / GiB:.1f} GiB leaves {max(kv_budget, 0) / GiB:.2f} "
                "GiB after weights and activations. Use a larger memory_fraction"
            )
        if slots - 1 < max_num_seqs:
            logger.warning(
                "recurrent state memory holds %d requests' states at once (max_num_seqs %d); "
                "more wait for a slot",
                slots - 1,
                max_num_seqs,
            )
        kv_budget -= slots * per_slot
    need_min = MIN_KV_TOKENS if max_model_len is None else max(max_model_len, 1)
    if layout.num_groups == 0:  # recurrent layers only: blocks are never used
        return plan(2, max_model_len or model_max_len, slots)
    budget_blocks = max(kv_budget, 0) // bytes_per_block
    if budget_blocks < blocks_for(need_min):
        need_bytes = blocks_for(need_min) * bytes_per_block + slots * per_slot
        if explicit:
            room = max_tokens_in(layout, budget_blocks, block_size, chunk, need_min)
            raise ValueError(
                f"kv_cache_memory_bytes (--kv-cache-memory-bytes, $VLLM_CPU_KVCACHE_SPACE) "
                f"{kv_cache_memory_bytes} holds {room} tokens of KV, fewer than {need_min}; "
                f"use at least {need_bytes}"
            )
        # Rounded up, so the suggested value really fits.
        fits = math.ceil(100 * (weights_bytes + activation_bytes + need_bytes) / total) / 100
        room = max_tokens_in(layout, budget_blocks, block_size, chunk, need_min)
        raise ValueError(
            f"not enough memory for the KV cache: memory_fraction (--gpu-memory-utilization) "
            f"{memory_fraction} of {total / GiB:.1f} GiB is {budget / GiB:.2f} GiB, but the "
            f"weights take {weights_bytes / GiB:.2f} GiB and activations "
            f"{activation_bytes / GiB:.2f} GiB, leaving room for "
            f"{room} tokens of KV (need {need_min}). "
            + (f"Use memory_fraction >= {fits:.2f}" if fits <= 1 else "Use a smaller model")
            + (", or a smaller max_model_len (--max-model-len)" if max_model_len else "")
        )
    if max_model_len is None:
        # Capped so one full request fits.
        length = max_tokens_in(layout, budget_blocks, block_size, chunk, model_max_len)
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
    useful = blocks_for(length) * max_num_seqs
    return plan(min(budget_blocks, useful) + 1, length, slots)  # + the null block


def probe_activation_bytes(model, allocate, extra, block_size: int, num_tokens: int) -> float:
    """Peak memory of a forward pass per token, measured on a ``num_tokens``-token prompt.

    ``allocate(num_blocks)`` makes a K/V pool (with two state slots) for ``model``;
    ``extra(md)`` the model's other step arguments (KV cache groups, state slots). Both
    are dropped afterwards.
    """
    n = num_tokens
    num_blocks = cdiv(n, block_size) + 1
    cache = allocate(num_blocks)
    md = AttentionMetadata.build([n], [n], [list(range(1, num_blocks))], block_size)
    mx.eval(cache.arrays())
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    logits = model(
        mx.zeros((n,), mx.int32),
        mx.arange(n, dtype=mx.int32),
        md,
        cache,
        logits_indices=mx.array([n - 1], dtype=mx.int32),
        **extra(md),
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


def agree_on_plan(plan: KVPlan, group: mx.distributed.Group) -> KVPlan:
    """Tensor parallel: the plan every rank can hold (the smallest pool and context of
    all ranks'). Every rank of ``group`` calls it after planning its own shard."""
    mine = mx.array([plan.num_blocks, plan.max_model_len], dtype=mx.int32)
    num_blocks, max_model_len = mx.distributed.all_min(mine, group=group).tolist()
    if (num_blocks, max_model_len) == (plan.num_blocks, plan.max_model_len):
        return plan
    kv_bytes = (num_blocks - 1) * plan.bytes_per_block
    return replace(plan, num_blocks=num_blocks, max_model_len=max_model_len, kv_bytes=kv_bytes)
