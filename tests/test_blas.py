"""Binding an optimized BLAS under MLX (mlxserve/cpu/blas.py): which one, why, and right answers.

Each choice is made once per process, when a model is loaded or a command starts
(mlxserve.settings.start), so every case runs in a fresh interpreter.
Speed is measured in bench/matmul.py, never here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.cpu import blas
from tests.paths import ROOT

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS binding is Linux-only")

# In the child: the choice, then float32 matmuls through MLX against numpy in float64.
CHILD = """
import json, numpy as np, mlxserve, mlx.core as mx
from mlxserve import settings
from mlxserve.cpu import blas
settings.start()
rng = np.random.default_rng(0)
errors = {}
for m, k, n in [(1, 40, 96), (7, 300, 33), (64, 576, 129)]:
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = np.array(mx.array(x) @ mx.array(w).T)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    errors[f"{m}x{k}x{n}"] = float(np.abs(got - want).max() / np.abs(want).max())
print(json.dumps({"info": blas.blas_info(), "errors": errors}))
"""


def run_child(env: dict[str, str], pythonpath: list[Path] = ()) -> tuple[dict, str]:
    """(the child's report, its stderr) with ``env`` on top of ours."""
    path = os.pathsep.join([*map(str, pythonpath), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=dict(os.environ, PYTHONPATH=path, **env),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def assert_right(report: dict) -> None:
    for shape, err in report["errors"].items():
        assert err < 1e-5, (shape, err)


def test_blas_can_be_turned_off_and_says_why_without_warning() -> None:
    report, stderr = run_child({"MLXSERVE_BLAS": "off"})
    assert report["info"]["library"] is None
    assert report["info"]["reason"] == "MLXSERVE_BLAS=off"
    assert "no optimized BLAS" not in stderr
    assert_right(report)


@linux_only
def test_a_bad_path_falls_back_to_mlx_with_one_warning_naming_the_fix() -> None:
    report, stderr = run_child({"MLXSERVE_BLAS": "/nonexistent/libopenblas.so.0"})
    assert report["info"]["library"] is None
    assert report["info"]["reason"].startswith("could not load /nonexistent/")
    assert stderr.count("no optimized BLAS under MLX") == 1
    assert "pip install scipy-openblas32" in stderr and report["info"]["fix"]
    assert_right(report)


@linux_only
def test_auto_binds_openblas_from_pypi_with_no_system_library() -> None:
    # scipy-openblas32 is a dependency on Linux: with nothing from apt, auto binds it.
    assert blas.pypi_openblas() is not None, "scipy-openblas32 (a Linux dependency) is missing"
    report, _ = run_child({"MLXSERVE_BLAS": "auto"})
    info = report["info"]
    assert info["source"] == "pypi" and info["library"] == blas.pypi_openblas()
    assert_right(report)


@linux_only
def test_auto_falls_back_to_the_system_library_without_the_pypi_one(tmp_path: Path) -> None:
    if blas.system_openblas() is None:
        pytest.skip("no system OpenBLAS here (apt install libopenblas0-pthread); CI has one")
    fake = tmp_path / "scipy_openblas32"  # shadows the real package: a folder with no lib/
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    report, _ = run_child({"MLXSERVE_BLAS": "auto"}, pythonpath=[tmp_path])
    assert report["info"]["source"] == "system"
    assert report["info"]["library"] == blas.system_openblas()
    assert_right(report)


@linux_only
@pytest.mark.parametrize("gemv", ["auto", "off"])
def test_an_explicit_system_library_is_bound_with_and_without_the_gemv_shim(gemv: str) -> None:
    path = blas.system_openblas()
    if path is None:
        pytest.skip("no system OpenBLAS here (apt install libopenblas0-pthread); CI has one")
    report, _ = run_child({"MLXSERVE_BLAS": path, "MLXSERVE_BLAS_GEMV": gemv})
    assert report["info"]["library"] == path and report["info"]["source"] == "MLXSERVE_BLAS"
    assert (report["info"]["gemv_shim"] is None) == (gemv == "off")
    assert_right(report)


@linux_only
def test_binding_works_when_mlx_was_imported_before_mlxserve() -> None:
    code = (
        "import mlx.core, mlxserve; from mlxserve import settings; from mlxserve.cpu import blas; "
        "settings.start(); "
        "print(blas.blas_info()['source'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, MLXSERVE_BLAS="auto"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pypi"


@linux_only
def test_got_offsets_finds_libmlx_sgemm_slot_and_rejects_non_elf(tmp_path: Path) -> None:
    import mlx.core  # noqa: F401  (loads libmlx)

    elf = Path(blas._libmlx()).read_bytes()
    assert blas._got_offsets(elf, "cblas_sgemm")
    assert blas._got_offsets(elf, "no_such_symbol_anywhere") == []
    with pytest.raises(ValueError, match="ELF64"):
        blas._got_offsets(b"#!/bin/sh\n" + bytes(64), "cblas_sgemm")
