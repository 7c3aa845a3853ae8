"""KV pool sizing: hand-computed budgets, caps, and errors that name the knob."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve.kv_cache_spec import uniform_layout
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
