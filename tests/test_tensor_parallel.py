"""Tensor parallel (issue 16): TP=2 gives one process's greedy tokens; bad splits are
clear errors; a lost rank fails the engine within seconds and leaves no process.

Ranks are real processes on the ring backend on 127.0.0.1, started by the engine
(mlxserve/worker/launch.py). MLX has one distributed group per process, so every
tensor-parallel engine runs in a fresh process (tests/tp_script.py), bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlxserve import LLM
from mlxserve.cli.engine_args import add_engine_args, engine_config
from mlxserve.config import EngineConfig
from mlxserve.exceptions import ParameterError
from mlxserve.worker.spmd import ForwardInputs
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT
from tests.rank_helpers import (
    Spawn,
    alive,
    assert_logprobs_close,
    kill_a_rank_and_check_it_failed_fast,
    result_line,
)
from tests.server_harness import free_port
from tests.tp_script import SCENARIO_ARGS, SPEC, run_chats, run_logprobs, run_scenario


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny GQA llama: 4 heads / 2 KV heads, intermediate 128 (all divisible by 2)."""
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tp"), seed=3)
    return model_dir


# ------------------------------------------------------------------ no ranks
def test_forward_inputs_round_trip_through_one_int32_buffer() -> None:
    fi = ForwardInputs(
        num_blocks=40,
        input_ids=[7, 8, 1, 2, 3],
        query_lens=[1, 1, 3],
        context_lens=[9, 4, 3],
        block_tables=[[5, 6, 9], [2], [11]],
        logits_rows=[0, 1, 4],
        num_hidden_rows=1,
    )
    buf = fi.pack()
    assert buf.dtype == np.int32
    assert ForwardInputs.unpack(buf) == fi
    # Positions by hand: decodes at 8 and 3, the prefill at 0..2.
    assert fi.positions() == [8, 3, 0, 1, 2]


def test_tensor_parallel_size_is_validated_and_has_a_flag() -> None:
    with pytest.raises(ParameterError) as e:
        EngineConfig(tensor_parallel_size=0)
    assert e.value.parameter == "tensor_parallel_size"
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2"])
    assert engine_config(args, None).tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("heads", "kv_heads", "fits"),
    [(9, 3, "1, 3"), (6, 3, "1, 3")],  # 9 / 3 is SmolLM2-135M's shape
)
def test_head_counts_not_divisible_is_a_clear_error_before_any_rank_starts(
    tmp_path: Path, heads: int, kv_heads: int, fits: str
) -> None:
    _, model_dir = make_tiny_model_dir(
        tmp_path, hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads
    )
    with pytest.raises(ParameterError) as e:
        LLM(str(model_dir), tensor_parallel_size=2, num_blocks=16)
    assert e.value.parameter == "tensor_parallel_size"
    message = str(e.value)
    assert f"num_attention_heads ({heads})" in message
    assert f"num_key_value_heads ({kv_heads})" in message
    assert f"sizes that fit: {fits}" in message


def test_a_model_other_than_the_llama_family_is_a_clear_error() -> None:
    import mlx.nn as nn

    from mlxserve.models.tensor_parallel import check_tensor_parallel

    with pytest.raises(ParameterError) as e:
        check_tensor_parallel(nn.Linear(4, 4), 2)
    assert e.value.parameter == "tensor_parallel_size"
    assert "hand-written llama" in str(e.value)


# ---------------------------------------------------------------- ranks
# Each spawn costs seconds (every rank imports MLX and loads the model): one run checks
# several things.
def test_tp2_under_mlx_launch_with_speculation_equals_one_process(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Every rank runs the script (mlx.launch, ring); LLM(...) on rank 1 serves rank 0 and
    exits. Batching, chunked prefill, prefix caching and preemption, token for token, with
    n-gram drafts verified as decode rows: they reach every rank (one block table per
    verified position; fails with per-request tables). Greedy speculation changes no token,
    so the tokens equal one process that does not speculate. Both sides keep an 8-bit KV
    cache (kv_cache_dtype int8): each rank quantizes the rows of its own KV heads, one
    scale per row, so the shards hold what one process holds."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    cmd = [str(launcher), "-n", "2", "--backend", "ring", "--python", sys.executable]
    cmd += ["--starting-port", str(free_port())]  # ranks listen on it and the next one
    cmd += ["--env", f"PYTHONPATH={ROOT}", str(ROOT / "tests" / "tp_script.py")]
    args = ["scenario", str(tiny_dir), "--tp", "2", "--spec", "--kv-cache-dtype", "int8"]
    run = Spawn(args, tmp_path / "ranks.log", cmd=cmd)
    int8 = dict(kv_cache_dtype="int8", **SCENARIO_ARGS)
    one = run_scenario(LLM(str(tiny_dir), **int8))  # while the ranks start
    one_spec = run_scenario(LLM(str(tiny_dir), speculative_config=SPEC, **int8))
    out = run.finish()
    assert run.proc.returncode == 0, run.log()[-3000:]
    two = result_line(out, "RESULT")
    # The workload does what it claims (else the equality below proves less).
    assert one_spec["num_preemptions"] > 0
    assert one_spec["prefix_cache_hits"] > 0
    assert two["accepted"] > 0  # drafts were verified
    assert len(one["tokens"]) == 6 and all(len(t) == 24 for t in one["tokens"])
    assert two["tokens"] == one["tokens"]
    # Every step wrote the pools in place: none was copied (each was before the runner
    # dropped its saved pool arrays ahead of starting the other ranks' evaluation).
    assert two["pool_copied_steps"] == one["pool_copied_steps"] == 0
    assert two["num_preemptions"] == one_spec["num_preemptions"]
    assert two["prefix_cache_hits"] == one_spec["prefix_cache_hits"]
    assert two["accepted"] == one_spec["accepted"]
    # Embeddings are floats summed in another order across ranks: equal to rounding.
    np.testing.assert_allclose(two["embeddings"], one["embeddings"], rtol=1e-4, atol=1e-5)


def test_tp3_on_the_default_model_equals_one_process_then_a_killed_rank_fails_fast(
    tmp_path: Path,
) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, Q4_1 in the CPU kernels) splits 3 ways; then
    rank 1 is killed mid-generation: the engine fails within seconds, no rank is left."""
    with Spawn(["chat", "", "--tp", "3", "--then-fail"], tmp_path / "ranks.log") as run:
        llm = LLM(None, num_blocks=64)
        one, one_logprobs = run_chats(llm), run_logprobs(llm)
        three = json.loads(run.read_until("RESULT"))
        assert three["chats"] == one
        # Every teacher-forced token's log-prob within 0.02 nats of one process's.
        assert_logprobs_close(three["logprobs"], one_logprobs, nats=0.02)
        assert len(one) == 2 and all(len(t) >= 8 for t in one)  # real replies
        kill_a_rank_and_check_it_failed_fast(run)


# -------------------------------------------------------------- the server
def test_server_under_tp2_answers_like_one_process_then_exits_when_a_rank_dies(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """OpenAI SDK chat and stream (usage) equal one process's greedy reply; a stream
    the client drops frees its blocks; killing a rank ends the open stream with an
    error, and the server exits (status 1) with no rank left."""
    import httpx
    import openai

    from mlxserve import SamplingParams
    from tests.server_harness import start_server

    args = [str(tiny_dir), "--tensor-parallel-size", "2", "--dtype", "float32"]
    server = start_server([*args, "--num-blocks", "128"], tmp_path / "server.log")
    try:
        log = server.log()
        pids = log.split("ranks 1-1 are pids ")[1].split()[0]
        rank_pid = int(pids)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(
            model=tiny_dir.name, messages=messages, max_tokens=12, temperature=0
        )
        chunks = list(
            client.chat.completions.create(
                model=tiny_dir.name,
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        one = LLM(str(tiny_dir), dtype="float32", num_blocks=128)
        params = SamplingParams(max_tokens=12, temperature=0)
        want = one.chat(messages, params, use_tqdm=False)[0].outputs[0]
        assert reply.choices[0].message.content == want.text
        assert reply.usage.completion_tokens == len(want.token_ids)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == want.text
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)

        # A dropped stream: its blocks are freed (rank 0 owns every rank's block tables).
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json={"model": tiny_dir.name, "prompt": "Once", "max_tokens": 1500, "stream": True},
            timeout=60,
        ) as r:
            assert r.status_code == 200
            for _ in zip(range(5), r.iter_lines(), strict=False):
                pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            usage = [ln for ln in metrics.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
            if usage and float(usage[0].split()[-1]) == 0.0:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"blocks not freed after a dropped stream: {usage}")

        # A rank dies mid-stream: the stream ends with an error, the server exits.
        body = {"model": tiny_dir.name, "prompt": "Once", "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            os.kill(rank_pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest and "rank 1 exited" in rest, rest[-2000:]
        server.proc.wait(timeout=60)
        assert server.proc.returncode == 1, server.log()[-3000:]
        assert "a rank is gone" in server.log()
        assert not alive(rank_pid)
    finally:
        server.stop()


def test_a_broken_ring_names_the_rank_that_exits_a_moment_later(monkeypatch) -> None:
    """A killed rank's sockets close before its process can be reaped: the collective
    fails first. The error still names the rank and its signal once it is reaped (within
    the grace period), and falls back to the ring's own error when no rank exits."""
    from types import SimpleNamespace

    from mlxserve.worker import spmd

    group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    polls = []

    def reaped_on_the_third_poll() -> str | None:
        polls.append(time.monotonic())
        return "rank 1 exited (killed by signal 9)" if len(polls) >= 3 else None

    channel = spmd.StepChannel(group, reaped_on_the_third_poll)
    error = channel.lost(RuntimeError("[ring] Recv failed"))
    assert str(error) == (
        "tensor parallel: a rank is gone (rank 1 exited (killed by signal 9)); the engine stops"
    )
    monkeypatch.setattr(spmd, "EXIT_GRACE_SECONDS", 0.1)
    t0 = time.monotonic()
    error = spmd.StepChannel(group, lambda: None).lost(RuntimeError("[ring] Recv failed"))
    assert "([ring] Recv failed)" in str(error)
    assert 0.1 <= time.monotonic() - t0 < 2.0
