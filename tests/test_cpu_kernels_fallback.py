"""When the CPU kernels cannot be built or loaded: one warning naming why, never a crash.

Each case starts from a fresh kernel state and an empty build cache (XDG_CACHE_HOME), so
nothing built by other tests is reused; the kernels themselves are tested in
tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.cpu import build
from mlxserve.cpu import kernels as cpu
from tests.paths import ROOT


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No kernels loaded yet, an empty cache; restored afterwards."""
    monkeypatch.setattr(cpu, "_state", {"module": None, "reason": "not attempted", "path": None})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXSERVE_CPU_KERNELS", raising=False)
    return tmp_path


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# Run in a process whose PATH never had a compiler, as on such a machine: MLX's CPU backend
# also asks once per process whether g++ exists (mx.compile fuses kernels with it, or
# leaves them unfused), and a test process has already been told yes.
NO_COMPILER = """
import json, logging, sys
import mlx.core as mx
from mlxserve.cpu import kernels as cpu
from mlxserve.loader import load_model
from tests.model_helpers import BlockPoolRunner, greedy_generate
records = []
handler = logging.Handler(logging.INFO)
handler.emit = records.append
logging.getLogger("mlxserve").addHandler(handler)
logging.getLogger("mlxserve").setLevel(logging.INFO)
first, second = cpu.available(), cpu.available()  # decided once: no second attempt
loaded = load_model(skip_tokenizer_init=True)
up = loaded.model.model.layers[0].mlp.up_proj
runner = BlockPoolRunner(loaded.model, num_blocks=4, block_size=16)
tokens, _ = greedy_generate(runner, {"a": json.loads(sys.argv[1])}, 4)
try:
    w, scales = mx.zeros((1, 4), mx.uint32), mx.ones((1, 1))
    cpu.quantized_matmul(mx.zeros((1, 32)), w, scales, scales, 32, 4)
    qmm_error = None
except RuntimeError as e:
    qmm_error = str(e)
print(json.dumps({
    "available": [first, second, cpu.info()["available"]],
    "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
    "status": cpu.status(),
    "up_proj": type(up).__name__,
    "tokens": tokens["a"],
    "qmm_error": qmm_error,
}))
"""


def test_no_compiler_gives_one_warning_and_the_previous_path(
    tmp_path: Path, llamacpp_oracle: dict
) -> None:
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "MLXSERVE_CPU_KERNELS")}
    env |= {"PATH": str(tmp_path / "bin"), "PYTHONPATH": str(ROOT)}  # no cc, gcc, clang, g++
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # nothing built by other tests
    case = llamacpp_oracle["greedy"][0]
    cmd = [sys.executable, "-c", NO_COMPILER, json.dumps(case["prompt_ids"])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["available"] == [False, False, False]
    [warning] = [w for w in out["warnings"] if "CPU kernels" in w]
    assert "no CC compiler found" in warning and "previous CPU path" in warning
    assert "no CC compiler found" in out["status"]
    # Dequantized for BLAS (Linear), or MLX's QuantizedLinear; not the kernels' layer.
    assert out["up_proj"] in ("Linear", "QuantizedLinear")
    # The same weights give llama.cpp's greedy tokens on that path.
    assert out["tokens"] == [step["id"] for step in case["steps"][:4]]
    assert "no CC compiler found" in out["qmm_error"]


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
