"""Process settings (mlxserve/settings.py): each MLXSERVE_* variable is one field's default,
read and validated in one place, and importing mlxserve binds nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxserve import settings
from mlxserve.exceptions import ParameterError
from mlxserve.settings import Settings
from tests.paths import ROOT


def test_unset_variables_give_the_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    assert Settings() == Settings(
        blas="auto",
        blas_gemv=True,
        cpu_kernels=True,
        cpu_threads=None,
        cpu_int8="auto",
        cpu_dequantize=True,
        metal_prefill="tiled",
    )


def test_each_variable_sets_its_field() -> None:
    env = {
        "MLXSERVE_BLAS": "/opt/lib/libopenblas.so",
        "MLXSERVE_BLAS_GEMV": "off",
        "MLXSERVE_CPU_KERNELS": "0",
        "MLXSERVE_CPU_THREADS": " 3 ",
        "MLXSERVE_CPU_INT8": "0",
        "MLXSERVE_CPU_DEQUANTIZE": "no",
        "MLXSERVE_METAL_PREFILL": " SIMT",
    }
    got = Settings.from_env(env)
    assert got == Settings(
        blas="/opt/lib/libopenblas.so",
        blas_gemv=False,
        cpu_kernels=False,
        cpu_threads=3,
        cpu_int8="off",
        cpu_dequantize=False,
        metal_prefill="simt",
    )
    assert sorted(settings.ENV.values()) == sorted(env)  # one field per variable
    assert Settings.from_env({"MLXSERVE_CPU_INT8": "1"}).cpu_int8 == "on"
    assert Settings.from_env({"MLXSERVE_BLAS": "OFF"}).blas == "off"


@pytest.mark.parametrize(
    ("env", "parameter"),
    [
        ({"MLXSERVE_CPU_INT8": "sometimes"}, "MLXSERVE_CPU_INT8"),
        ({"MLXSERVE_CPU_THREADS": "many"}, "MLXSERVE_CPU_THREADS"),
        ({"MLXSERVE_CPU_THREADS": "0"}, "MLXSERVE_CPU_THREADS"),
    ],
)
def test_a_bad_value_names_its_variable(env: dict[str, str], parameter: str) -> None:
    with pytest.raises(ParameterError) as e:
        Settings.from_env(env)
    assert e.value.parameter == parameter
    assert next(iter(env.values())) in str(e.value)


def test_use_overrides_the_environment_inside_its_block(monkeypatch) -> None:
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "on")
    assert settings.current().cpu_int8 == "on"
    with settings.use(Settings(cpu_int8="off")):
        assert settings.current().cpu_int8 == "off"
    assert settings.current().cpu_int8 == "on"


def test_describe_marks_what_is_not_the_default() -> None:
    lines = settings.describe(Settings(cpu_threads=2))
    assert "cpu_threads=2 (MLXSERVE_CPU_THREADS) *" in lines
    assert "blas=auto (MLXSERVE_BLAS)" in lines
    assert len(lines) == len(settings.ENV)


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS binding is Linux-only")
def test_importing_mlxserve_binds_no_blas_until_a_command_or_model_starts() -> None:
    code = (
        "import json, mlxserve; from mlxserve import settings; from mlxserve.cpu import blas\n"
        "before = blas.blas_info()['reason']\n"
        "settings.start()\n"
        "print(json.dumps([before, blas.blas_info()['reason']]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, MLXSERVE_BLAS="off"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["not attempted", "MLXSERVE_BLAS=off"]
