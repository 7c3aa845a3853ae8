"""Pipeline parallel (issue 16): PP=2 gives one process's greedy tokens; layer ranges and
micro-batches are what they claim; bad settings are clear errors; a killed or a stuck
rank fails the engine within a bounded time and leaves no process.

Ranks are real processes on the ring backend on 127.0.0.1 (tests/tp_script.py, one
engine per process: MLX has one distributed group per process), bounded in time.
"""

from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from mlxserve import LLM
from mlxserve.cli.engine_args import add_engine_args, engine_config
from mlxserve.config import EngineConfig
from mlxserve.exceptions import ParameterError
from mlxserve.models.pipeline_parallel import (
    check_pipeline_parallel,
    micro_batch_metadata,
    micro_batches,
    stage_ranges,
)
from mlxserve.ops import AttentionMetadata
from mlxserve.worker.pipeline import STAT_NAMES
from tests.engine_helpers import make_tiny_model_dir
from tests.rank_helpers import (
    Spawn,
    assert_logprobs_close,
    fail_a_rank,
    kill_a_rank_and_check_it_failed_fast,
)
from tests.tp_script import SCENARIO_ARGS, SPEC, run_chats, run_logprobs, run_scenario

STUCK_TIMEOUT = 5.0  # distributed_timeout_seconds in the stuck-rank run


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny llama: 2 layers, so one per rank at PP=2."""
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("pp"), seed=3)
    return model_dir


# ------------------------------------------------------------------ no ranks
def _brute_force_best(costs: list[int], head: int, size: int) -> int:
    """The smallest max rank cost over every contiguous split (an independent oracle)."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), size - 1):
        bounds = [0, *cuts, n]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[-1] += head
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize(
    ("costs", "head", "size"),
    [
        ([4] * 8, 0, 2),
        ([4] * 30, 32, 2),  # SmolLM2-like: a tied head worth ~8 layers
        ([4] * 80, 5, 2),  # a 70B: the head ~1.2 layers
        ([3, 9, 1, 1, 7, 2, 2, 5], 4, 3),
        ([1, 1, 1], 100, 3),  # a huge head still leaves a layer on the last rank
    ],
)
def test_stage_ranges_are_contiguous_and_minimise_the_largest_rank(
    costs: list[int], head: int, size: int
) -> None:
    ranges = stage_ranges(costs, head, size)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(a < b for a, b in ranges)  # every rank has a layer
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(ranges))
    loads = [sum(costs[a:b]) for a, b in ranges]
    loads[-1] += head
    assert max(loads) == _brute_force_best(costs, head, size)


def test_stage_ranges_by_hand() -> None:
    assert stage_ranges([1] * 8, 0, 2) == [(0, 4), (4, 8)]
    assert stage_ranges([1] * 8, 2, 2) == [(0, 5), (5, 8)]  # 5 vs 3 + 2
    assert stage_ranges([1] * 2, 0, 2) == [(0, 1), (1, 2)]


@pytest.mark.parametrize(
    ("query_lens", "m", "want"),
    [
        ((1, 1, 1, 1), 2, [(0, 2), (2, 4)]),
        ((1, 1, 1), 2, [(0, 2), (2, 3)]),
        ((1, 1, 16), 2, [(0, 2), (2, 3)]),  # cannot split a request
        ((16, 1, 1, 1), 2, [(0, 1), (1, 4)]),
        ((5,), 2, [(0, 1)]),  # one request: one micro-batch
        ((1, 1, 1, 1, 1, 1), 3, [(0, 2), (2, 4), (4, 6)]),
        ((1, 1), 4, [(0, 1), (1, 2)]),
        ((2, 2, 2, 2), 1, [(0, 4)]),
    ],
)
def test_micro_batches_split_requests_contiguously_by_tokens(query_lens, m, want) -> None:
    assert micro_batches(query_lens, m) == want


@pytest.mark.parametrize(
    ("query_lens", "min_tokens", "want"),
    [
        ((1,) * 8, 64, [(0, 8)]),  # a decode step stays whole
        ((1,) * 8, 4, [(0, 4), (4, 8)]),
        ((1, 1, 64, 64), 64, [(0, 3), (3, 4)]),  # a prefill step splits
        ((1, 1, 64), 64, [(0, 3)]),  # 66 tokens: not two micro-batches' worth
    ],
)
def test_micro_batches_need_enough_tokens_each(query_lens, min_tokens, want) -> None:
    assert micro_batches(query_lens, 2, min_tokens) == want


def test_micro_batch_metadata_equals_metadata_built_for_those_requests() -> None:
    query_lens, context_lens = [1, 1, 5, 3], [9, 4, 5, 11]
    tables = [[5, 6, 9], [2], [11, 12], [3, 4, 7]]
    md = AttentionMetadata.build(query_lens, context_lens, tables, 4)
    sub, t0, t1 = micro_batch_metadata(md, 1, 3)
    assert (t0, t1) == (1, 7)
    want = AttentionMetadata.build(query_lens[1:3], context_lens[1:3], tables[1:3], 4)
    assert sub.num_decodes == want.num_decodes == 1
    assert sub.query_lens == want.query_lens and sub.context_lens_host == want.context_lens_host
    for name in ("slot_mapping", "query_start_loc", "context_lens"):
        assert getattr(sub, name).tolist() == getattr(want, name).tolist(), name
    # The step's table width is kept (a request reads what it reads in the whole step).
    assert sub.block_tables.shape == (2, 3)
    assert sub.block_tables[:, :2].tolist() == want.block_tables.tolist()
    assert micro_batch_metadata(md, 0, 4)[0] is md


def test_pipeline_parallel_size_is_validated_and_has_flags() -> None:
    for bad in (0, -1):
        with pytest.raises(ParameterError) as e:
            EngineConfig(pipeline_parallel_size=bad)
        assert e.value.parameter == "pipeline_parallel_size"
    with pytest.raises(ParameterError) as e:
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert e.value.parameter == "pipeline_parallel_size"
    assert "tensor and pipeline parallelism do not combine" in str(e.value)
    with pytest.raises(ParameterError) as e:
        EngineConfig(distributed_timeout_seconds=0)
    assert e.value.parameter == "distributed_timeout_seconds"
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["-pp", "2", "--distributed-timeout-seconds", "7.5"])
    config = engine_config(args, None)
    assert config.pipeline_parallel_size == 2 and config.world_size == 2
    assert config.distributed_timeout_seconds == 7.5


def test_more_stages_than_layers_or_another_architecture_is_a_clear_error(
    tiny_dir: Path,
) -> None:
    with pytest.raises(ParameterError) as e:
        LLM(str(tiny_dir), pipeline_parallel_size=3, num_blocks=16)  # before any rank starts
    assert e.value.parameter == "pipeline_parallel_size"
    assert "more than this model's 2 layers" in str(e.value)
    import mlx.nn as nn

    with pytest.raises(ParameterError) as e:
        check_pipeline_parallel(nn.Linear(4, 4), 2)
    assert e.value.parameter == "pipeline_parallel_size"
    assert "hand-written llama" in str(e.value)


# ---------------------------------------------------------------- ranks
# Each spawn costs seconds (every rank imports MLX and loads the model): one run checks
# several things.
def test_pp2_equals_one_process_then_a_stuck_rank_is_stopped(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Batching, chunked prefill, prefix caching, preemption, embeddings and n-gram drafts
    (verified as decode rows), token for token with one process that does not speculate;
    rank 1 received micro-batches and sent logits back. Then rank 1 stops responding
    (SIGSTOP: alive, not answering) mid-generation: after distributed_timeout_seconds the
    engine stops it and fails with that reason."""
    # Micro-batches of >= 2 tokens: decode steps of 2+ requests split too.
    args = ["scenario", str(tiny_dir), "--pp", "2", "--micro-batch-tokens", "2", "--spec"]
    args += ["--timeout", str(STUCK_TIMEOUT)]
    run = Spawn([*args, "--then-fail"], tmp_path / "ranks.log")
    one = run_scenario(LLM(str(tiny_dir), **SCENARIO_ARGS))  # while the ranks start
    one_spec = run_scenario(LLM(str(tiny_dir), speculative_config=SPEC, **SCENARIO_ARGS))
    two = json.loads(run.read_until("RESULT"))
    assert one_spec["num_preemptions"] > 0 and one_spec["prefix_cache_hits"] > 0
    assert len(one["tokens"]) == 6 and all(len(t) == 24 for t in one["tokens"])
    assert two["accepted"] > 0  # drafts were verified
    assert two["tokens"] == one["tokens"]
    # The steps that write each pool once wrote them in place (each was copied before the
    # runner dropped its saved pool arrays ahead of starting the other ranks' evaluation).
    # Rank 0's steps of two micro-batches write each pool twice: the second write copies
    # when the first micro-batch's attention has not run yet (a busy CPU; PoolWatch counts
    # those apart), a cost, not a wrong token (the tokens are compared above).
    assert one["pool_copied_steps"] == 0 and one["pool_rewrite_copied_steps"] == 0
    assert two["pool_copied_steps"] == 0
    for counter in ("num_preemptions", "prefix_cache_hits", "accepted"):
        assert two[counter] == one_spec[counter], counter
    # Hidden states cross ranks unchanged (no sum), but the micro-batches multiply fewer
    # rows at a time than one process does, and a fused projection's BLAS call may sum in
    # another order for another row count: float32 rounding (measured 1.8e-7), no more.
    np.testing.assert_allclose(two["embeddings"], one["embeddings"], rtol=1e-5, atol=1e-6)
    stats = dict(zip(STAT_NAMES, two["stage_stats"][1], strict=False))
    hidden_bytes = 64 * 4  # a token's hidden state, float32
    assert stats["forwards"] > 0
    assert stats["micro_batches"] > stats["forwards"]  # steps were split
    assert stats["bytes_received"] > 0 and stats["bytes_received"] % hidden_bytes == 0
    assert stats["bytes_sent"] > 0  # logits (and hidden rows) back to rank 0

    failed = fail_a_rank(run, signal.SIGSTOP, timeout=STUCK_TIMEOUT + 60)
    message = f"made no progress for {STUCK_TIMEOUT:g} s (distributed_timeout_seconds)"
    if failed.get("type"):
        assert failed["type"] == "RankLostError"
        assert message in failed["message"] and "pipeline parallel" in failed["message"]
        assert failed["gone"] is True
    else:  # the watchdog ended the process
        assert message in run.log()
    assert not failed["rank_left"]


def test_pp2_on_the_default_model_equals_one_process_then_a_killed_rank_fails_fast(
    tmp_path: Path,
) -> None:
    """SmolLM2-135M (30 layers, Q4_1, a tied head: the embedding also on the last rank);
    then rank 1 is killed mid-generation: the engine fails within seconds, no rank left."""
    with Spawn(["chat", "", "--pp", "2", "--then-fail"], tmp_path / "ranks.log") as run:
        llm = LLM(None, num_blocks=64)
        one, one_logprobs = run_chats(llm), run_logprobs(llm)
        two = json.loads(run.read_until("RESULT"))
        assert two["chats"] == one
        # Every teacher-forced token's log-prob within 0.02 nats of one process's.
        assert_logprobs_close(two["logprobs"], one_logprobs, nats=0.02)
        assert len(one) == 2 and all(len(t) >= 8 for t in one)  # real replies
        kill_a_rank_and_check_it_failed_fast(run)
