"""KV pool sizing: hand-computed budgets, caps, and errors that name the knob."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve.kv_cache_spec import (
    FULL_ATTENTION,
    RECURRENT,
    SLIDING_WINDOW,
    LayerCacheSpec,
    make_layout,
    uniform_layout,
)
from mlxserve.worker.memory import GiB, plan_kv_cache

# SmolLM2-135M in float32: 30 layers x 3 kv heads x 64 dims x 2 (K, V) x 4 bytes.
SMOL_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # 46,080


def plan(**kw):
    args = dict(
        layout=uniform_layout(30, 3, 64),
        dtype=mx.float32,
        block_size=16,
        model_max_len=8192,
        max_model_len=None,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        memory_fraction=0.5,
        weights_bytes=GiB // 4,
        activation_bytes=GiB // 8,
        total_memory=16 * GiB,
    )
    return plan_kv_cache(**args | kw)


def test_pool_is_capped_by_what_max_num_seqs_can_use() -> None:
    p = plan()
    # 8 GiB - 0.375 GiB holds ~177k tokens, but 64 x 8192 = 524,288 would be needed to
    # cap; so the budget is the limit here.
    tokens = (8 * GiB - GiB // 4 - GiB // 8) // SMOL_BYTES_PER_TOKEN
    assert p.num_blocks == tokens // 16 + 1
    assert p.max_model_len == 8192
    small = plan(max_num_seqs=2)
    assert small.num_blocks == 2 * 8192 // 16 + 1


def test_max_model_len_is_capped_to_fit_one_request() -> None:
    p = plan(total_memory=GiB, memory_fraction=0.5)  # 0.125 GiB left = 2912 tokens
    kv_tokens = (GiB // 2 - GiB // 4 - GiB // 8) // SMOL_BYTES_PER_TOKEN
    assert p.max_model_len == kv_tokens == 2912
    assert "max concurrency at max_model_len: 1.0x" in p.describe(64, 2048)


def test_not_enough_memory_names_the_knob_and_a_value_that_fits() -> None:
    with pytest.raises(ValueError) as e:
        plan(total_memory=GiB, memory_fraction=0.3)
    msg = str(e.value)
    assert "memory_fraction (--gpu-memory-utilization) 0.3" in msg
    # (0.25 + 0.125) GiB + 256 tokens x 45 KiB = 0.386 GiB of 1 GiB.
    assert "Use memory_fraction >= 0.39" in msg


def test_explicit_max_model_len_beyond_model_or_pool() -> None:
    with pytest.raises(ValueError, match="larger than the model's context length 8192"):
        plan(max_model_len=10000)
    with pytest.raises(ValueError, match=r"num_blocks 5 holds 64 tokens.*num_blocks >= 8"):
        plan(num_blocks=5, max_model_len=100)
    assert plan(num_blocks=5).max_model_len == 64


# One full-attention layer and one other (a window of 64 tokens, or a recurrent state), both
# 2 kv heads x 16 dims in float32: 16 tokens x 2 x (16 + 16) x 4 = 4096 bytes per block.
FULL = LayerCacheSpec(FULL_ATTENTION, 2, 16, 16)
WINDOW = LayerCacheSpec(SLIDING_WINDOW, 2, 16, 16, window=64)
STATE = LayerCacheSpec(RECURRENT, state_shapes=((2, 64),), state_dtypes=("float32",))  # 512 B
MiB = 2**20


def test_windowed_layer_holds_its_window_not_the_sequence() -> None:
    """A (window, full) model: groups share one 4096-byte tensor, and one request holds its
    full blocks plus ceil((64 - 1 + 32) / 16) + 1 = 7 window blocks."""
    kv_budget = 100 * 4096  # exactly 100 blocks after weights and activations
    args = dict(dtype=mx.float32, max_num_batched_tokens=32, memory_fraction=1.0)
    args |= dict(total_memory=kv_budget + 2 * MiB, weights_bytes=MiB, activation_bytes=MiB)
    p = plan(layout=make_layout([WINDOW, FULL]), **args)
    assert p.bytes_per_block == 4096
    # max_model_len L: ceil(L / 16) + 7 <= 100 blocks -> L = 93 x 16.
    assert p.max_model_len == 93 * 16 == 1488 and p.num_blocks == 100 + 1
    # Without windows the same bytes (two tensors, 8192 B/block) hold 50 blocks = 800 tokens.
    p = plan(layout=uniform_layout(2, 2, 16), **args)
    assert p.bytes_per_block == 8192 and p.max_model_len == 50 * 16 == 800


def test_recurrent_state_slots_come_out_of_the_kv_budget() -> None:
    """A (recurrent, full) model, 64 sequences: 1 null + 64 live + 128 snapshot slots of
    512 bytes come off the 16 MiB KV budget before blocks are counted."""
    args = dict(dtype=mx.float32, max_model_len=2048, memory_fraction=0.5)
    args |= dict(total_memory=64 * MiB, weights_bytes=8 * MiB, activation_bytes=8 * MiB)
    p = plan(layout=make_layout([STATE, FULL]), **args)
    assert p.num_state_slots == 1 + 64 + 2 * 64 == 193
    assert p.state_bytes == 193 * 512
    assert p.num_blocks == (16 * MiB - 193 * 512) // 4096 + 1 == 4072
    # Without prefix caching there are no snapshots: 65 slots.
    p = plan(layout=make_layout([STATE, FULL]), enable_prefix_caching=False, **args)
    assert p.num_state_slots == 65
    assert p.num_blocks == (16 * MiB - 65 * 512) // 4096 + 1 == 4088
    # States take at most half the KV budget (8 MiB): of 5 MiB states that affords one
    # slot besides the null one, so one sequence at a time (with a warning).
    big = LayerCacheSpec(RECURRENT, state_shapes=((5 * MiB // 4,),), state_dtypes=("float32",))
    p = plan(layout=make_layout([big, FULL]), **args)
    assert p.num_state_slots == 1 + 8 // 5 == 2
