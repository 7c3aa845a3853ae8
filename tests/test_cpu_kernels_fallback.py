"""When the CPU kernels cannot be built or loaded: one warning naming why, never a crash.

Each case starts from a fresh kernel state and an empty build cache (XDG_CACHE_HOME), so
nothing built by other tests is reused; the kernels themselves are tested in
tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxserve import cpu
from mlxserve.cpu import build
from mlxserve.loader import load_model
from tests.model_helpers import BlockPoolRunner, greedy_generate


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No kernels loaded yet, an empty cache; restored afterwards."""
    monkeypatch.setattr(cpu, "_state", {"module": None, "reason": "not attempted", "path": None})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXSERVE_CPU_KERNELS", raising=False)
    return tmp_path


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_no_compiler_gives_one_warning_and_the_previous_path(
    fresh: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    llamacpp_oracle: dict,
) -> None:
    (fresh / "bin").mkdir()
    monkeypatch.setenv("PATH", str(fresh / "bin"))  # no cc, gcc, clang
    monkeypatch.delenv("CC", raising=False)
    with caplog.at_level(logging.INFO, logger="mlxserve"):
        assert not cpu.available()
        assert not cpu.available()  # decided once: no second attempt, no second warning
        loaded = load_model(skip_tokenizer_init=True)
    [warning] = [w for w in warnings_of(caplog) if "CPU kernels" in w]
    assert "no CC compiler found" in warning and "previous CPU path" in warning
    assert "no CC compiler found" in cpu.status() and cpu.info()["available"] is False
    up = loaded.model.model.layers[0].mlp.up_proj
    assert not isinstance(up, cpu.CpuQuantizedLinear)
    assert isinstance(up, (nn.Linear, nn.QuantizedLinear))  # dequantized for BLAS, or MLX's
    # The same weights give llama.cpp's greedy tokens on that path.
    case = llamacpp_oracle["greedy"][0]
    runner = BlockPoolRunner(loaded.model, num_blocks=4, block_size=16)
    tokens, _ = greedy_generate(runner, {"a": case["prompt_ids"]}, 4)
    assert tokens["a"] == [step["id"] for step in case["steps"][:4]]
    w, scales = mx.zeros((1, 4), mx.uint32), mx.ones((1, 1))
    with pytest.raises(RuntimeError, match="no CC compiler found"):
        cpu.quantized_matmul(mx.zeros((1, 32)), w, scales, scales, 32, 4)


def test_a_broken_cached_build_is_refused_with_one_warning(
    fresh: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = build.built_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING, logger="mlxserve"):
        assert not cpu.available()
    [warning] = warnings_of(caplog)
    assert "CPU kernels unavailable" in warning and str(path.name) in warning


def test_turned_off_says_so_without_a_warning(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLXSERVE_CPU_KERNELS", "off")
    with caplog.at_level(logging.WARNING, logger="mlxserve"):
        assert not cpu.available()
    assert warnings_of(caplog) == []
    assert cpu.status() == "MLXSERVE_CPU_KERNELS=off"
    assert not (fresh / "cache").exists()  # nothing was built
