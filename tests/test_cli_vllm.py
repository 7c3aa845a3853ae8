"""A copied `vllm serve` line starts mlxserve: vLLM's flags work, or say why they do nothing.

Flags checked here: from vLLM's docs, `VLLM_CPU_KVCACHE_SPACE` and `--dtype=bfloat16`
(docs/getting_started/installation/cpu.md), `--trust-remote-code --max-model-len 4096`
(vLLM's example of launching `vllm serve` from Python); and the ones the issue lists as
copied lines that stopped: `--tensor-parallel-size`, `--pipeline-parallel-size`,
`--disable-log-requests`, `--swap-space`, `--quantization`, `--kv-cache-memory-bytes`,
`--enforce-eager`, `--kv-cache-dtype`, `--gpu-memory-utilization`, `--max-num-seqs`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx
import pytest

from mlxserve.cli.engine_args import engine_config
from mlxserve.cli.main import build_parser
from mlxserve.cli.vllm_compat import (
    ENGINE_FLAGS,
    SERVER_FLAGS,
    check_quantization,
    checkpoint_quantization,
    human_int,
    warn_no_effect,
)
from mlxserve.config import EngineConfig
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.exceptions import ParameterError
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT
from tests.server_harness import start_server

# The tiny model: 2 layers x 2 KV heads x head_dim 16, K and V, float32 on the CPU.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def mlxserve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    cmd = [sys.executable, "-m", "mlxserve", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=60)


def test_module_entry_point_version_and_bare_help() -> None:
    out = mlxserve("--version")
    assert (out.returncode, out.stdout) == (0, "mlxserve 0.1.0\n")
    out = mlxserve()
    assert out.returncode == 0 and out.stdout.startswith("usage: mlxserve [-h] [--version]")
    assert all(f" {name} " in out.stdout for name in ("run", "serve", "convert", "bench"))


def test_a_sub_command_error_shows_that_sub_commands_usage() -> None:
    out = mlxserve("serve", "--no-such-flag")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: mlxserve serve ")
    assert out.stderr.endswith("mlxserve serve: error: unrecognized arguments: --no-such-flag\n")


def test_a_copied_vllm_line_parses_and_warns_once_per_no_effect_flag(caplog) -> None:
    line = (
        "serve some/model --trust-remote-code --tensor-parallel-size 1 -pp 1 "
        "--disable-log-requests --swap-space 4 --quantization awq --enforce-eager "
        "--kv-cache-dtype auto --gpu-memory-utilization 0.9 --max-num-seqs 8 "
        "--max-model-len 8k --kv-cache-memory-bytes 2G --no-enable-chunked-prefill"
    )
    args = build_parser().parse_args(line.split())
    with caplog.at_level(logging.WARNING, logger="mlxserve"):
        warn_no_effect(args, SERVER_FLAGS)
        config = engine_config(args, args.model)  # warns about the engine's
    lines = [r.getMessage() for r in caplog.records]
    flags = [line.split(" has no effect here: ")[0] for line in lines]
    assert flags == [
        "--disable-log-requests",
        "--trust-remote-code",
        "--enforce-eager",
        "--swap-space 4",
        "--quantization awq",
        "--no-enable-chunked-prefill",
    ]
    assert all(len(line.splitlines()) == 1 for line in lines)
    assert (config.memory_fraction, config.max_num_seqs) == (0.9, 8)
    assert (config.max_model_len, config.kv_cache_memory_bytes) == (8000, 2 * 2**30)
    assert config.tensor_parallel_size == config.pipeline_parallel_size == 1
    # --kv-cache-dtype is a real engine flag now (int8 quantizes the KV cache).
    assert config.kv_cache_dtype == "auto"
    assert not warn_no_effect(build_parser().parse_args(["serve"]), ENGINE_FLAGS)


@pytest.mark.parametrize("flag", ["--data-parallel-size", "-dp"])
def test_data_parallel_size_above_one_is_a_clear_error(flag: str) -> None:
    """Tensor and pipeline parallel are implemented (tests/test_tensor_parallel.py,
    tests/test_pipeline_parallel.py); data parallel is not."""
    args = build_parser().parse_args(["serve", flag, "2"])
    with pytest.raises(ParameterError, match="must be 1 for now: data parallelism"):
        engine_config(args, None)
    out = mlxserve("serve", "--port", "1", flag, "2")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "got 2" in out.stderr


def test_tensor_with_pipeline_parallel_is_a_clear_error() -> None:
    out = mlxserve("serve", "--port", "1", "-tp", "2", "-pp", "2")
    assert out.returncode == 2 and out.stderr.startswith("error: ")
    assert "tensor and pipeline parallelism do not combine yet" in out.stderr


def test_human_readable_sizes_as_vllm() -> None:
    assert [human_int(t) for t in ("4096", "8k", "8K", "8Ki", "2G", "1.5k")] == [
        4096,
        8000,
        8192,
        8192,
        2 * 2**30,
        1500,
    ]
    for bad in ("", "x", "1.5", "-1"):
        with pytest.raises(Exception, match="expected an integer|not a whole number"):
            human_int(bad)


def test_kv_cache_space_env_and_bytes_flag_size_the_pool(tmp_path, monkeypatch) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")  # GiB, as vLLM reads it
    config = EngineConfig(model=str(model_dir), dtype="float32")
    budget = int(0.001 * 2**30)
    assert config.kv_cache_memory_bytes == budget
    engine = LLMEngine(config)
    tokens = budget // TINY_KV_BYTES_PER_TOKEN  # hand-computed: 2097 tokens
    assert engine.plan.num_blocks == tokens // 16 + 1  # + the null block
    # Capped so one full request fits in whole blocks: 131 x 16.
    assert engine.max_model_len == tokens // 16 * 16 == 2096
    # The flag wins over the environment; too small a budget names the knob and the need.
    args = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "1M"])
    assert engine_config(args, None).kv_cache_memory_bytes == 2**20
    with pytest.raises(ValueError, match="kv_cache_memory_bytes .* fewer than 256; use at least"):
        LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=4096))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ParameterError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB"):
        EngineConfig()


def test_vllm_cpu_docs_line_serves_unchanged(tmp_path) -> None:
    """`export VLLM_CPU_KVCACHE_SPACE=40; vllm serve facebook/opt-125m --dtype=bfloat16`
    (vLLM's CPU install guide), with the model replaced, plus the flags of vLLM's
    launch-from-Python example: `--trust-remote-code --max-model-len 4096`."""
    _, model_dir = make_tiny_model_dir(tmp_path)
    args = [str(model_dir), "--dtype=bfloat16", "--trust-remote-code", "--max-model-len", "4096"]
    server = start_server(args, tmp_path / "log", env={"VLLM_CPU_KVCACHE_SPACE": "40"})
    try:
        body = {"model": model_dir.name, "prompt": "The quick", "max_tokens": 3}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
    log = server.log()
    assert log.count("--trust-remote-code has no effect here: mlxserve never runs") == 1
    # 40 GiB is more than 64 requests of 4096 tokens can use: capped there, allocated as used.
    blocks = 64 * 4096 // 16
    assert f"KV cache: up to {blocks} blocks x 16 tokens" in log


def test_quantization_is_accepted_only_when_it_names_the_checkpoints_own() -> None:
    args = build_parser().parse_args(["serve", "--quantization", "gguf"])
    check_quantization(args, "gguf", {})  # the embedded model is a GGUF: accepted
    assert checkpoint_quantization("dir", {"quantization": {"bits": 4}}) == "mlx"
    assert checkpoint_quantization("dir", {"quantization_config": {"quant_method": "awq"}}) == "awq"
    assert checkpoint_quantization("dir", {}) is None
    with pytest.raises(ValueError, match="--quantization gguf does not match the checkpoint, "):
        check_quantization(args, "dir", {})
    out = mlxserve("run", "hi", "--max-tokens", "1", "--quantization", "awq")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --quantization awq does not match the checkpoint, which is quantized as gguf: "
        "mlxserve runs a checkpoint as it is quantized; drop the flag"
    )
