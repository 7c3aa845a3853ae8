"""`mlxserve doctor`: the facts it reports, on this machine and on faked ones."""

from __future__ import annotations

import platform
import re
import subprocess
import sys

import mlx.core as mx
import pytest

from mlxserve.cli import doctor
from mlxserve.utils import GiB
from tests.paths import ROOT
from tests.test_mlx_floor import mlx_ranges

DOCTOR = [sys.executable, "-m", "mlxserve.cli", "doctor"]


def run_doctor(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(DOCTOR + args, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_doctor_reports_this_machine_and_the_embedded_model() -> None:
    out = run_doctor(["--num-blocks", "65"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    text = out.stdout
    assert f"os:         {platform.system()} {platform.release()}" in lines or (
        f"os:         macOS {platform.mac_ver()[0]}" in lines
    )
    assert f"mlx:        {mx.__version__} — supported (>=0.32.3,<0.33)" in lines
    if not mx.metal.is_available():
        assert "metal:      not available (mx.metal.is_available() is False)" in text
        # mlxserve's CPU primitives where they build (these tests build them), else the
        # fallback; either way the reason names the missing Metal.
        assert re.search(r"kernels:    (cpu|fallback) \(mx.metal.is_available\(\) is False", text)
        assert any(line.startswith("self-tests: not run") for line in lines)
    else:  # a Mac: every variant of the model was self-tested, and passed
        checks = [line for line in lines if line.startswith("self-test:  ")]
        assert len(checks) == 4 and all(line.endswith(": ok") for line in checks), checks
    blas = next(line for line in lines if line.startswith("blas:"))
    if sys.platform == "linux":
        assert "OpenBLAS bound from" in blas or "pip install scipy-openblas32" in blas
    if not mx.metal.is_available():  # the quantized-matmul kernels, built here by the tests
        qmm = next(line for line in lines if line.startswith("cpu-qmm:"))
        assert re.fullmatch(
            r"cpu-qmm: +CPU kernels: (avx512|avx2|neon|scalar), (float activations|int8 "
            r"activations \((avx512vnni|avxvnni|avx2|neon|scalar)\)), \d+ threads .*",
            qmm,
        )
    # SmolLM2-135M: 30 layers, 9 heads, 3 KV heads of 64; float32 KV on the CPU is
    # 2 x 30 x 3 x 64 x 4 B = 45 KiB per token, 720 KiB per 16-token block (float16 on
    # Metal: 360 KiB)
    assert "SmolLM2-135M-Instruct" in text
    assert "30 layers, 9 heads, 3 KV heads x head_dim 64;" in text
    per_block = "720 KiB/block" if not mx.metal.is_available() else "360 KiB/block"
    assert "up to 64 blocks x 16 tokens" in text and per_block in text
    assert "max_model_len 1024" in text


@pytest.mark.parametrize("model", ["/no/such/model.gguf", "bad.gguf"])
def test_a_bad_model_is_a_one_line_error(tmp_path, model: str) -> None:
    if model == "bad.gguf":
        (tmp_path / model).write_bytes(b"not a gguf file at all")
        model = str(tmp_path / model)
    out = run_doctor([model])
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if not line.startswith("INFO")]
    assert len(errors) == 1 and errors[0].startswith("error: ") and model in errors[0], out.stderr
    assert "platform:" in out.stdout  # the system facts came first


def test_mlx_version_verdicts_and_the_pinned_range() -> None:
    floor, ceiling = mlx_ranges()[0]
    assert doctor.MLX_FLOOR == tuple(int(p) for p in floor.split("."))
    assert doctor.MLX_CEILING == tuple(int(p) for p in ceiling.split("."))
    assert "TOO OLD" in doctor.mlx_line("0.31.2")
    assert "TOO OLD" in doctor.mlx_line("0.32.2")
    assert "supported" in doctor.mlx_line("0.32.3")
    assert "supported" in doctor.mlx_line("0.32.4.dev20260101+abc")
    assert "newer than tested" in doctor.mlx_line("0.33.0")


def test_metal_device_line_from_a_faked_device() -> None:
    info = {
        "device_name": "Apple M2 Pro",
        "architecture": "applegpu_g14s",
        "memory_size": 32 * GiB,
        "max_recommended_working_set_size": int(21.5 * GiB),
        "max_buffer_length": 16 * GiB,
    }
    line = doctor.metal_line(True, lambda: info, lambda: 19)
    assert line == (
        "Apple M2 Pro (applegpu_g14s), 19 GPU cores, memory 32.0 GiB, "
        "recommended working set 21.5 GiB, max buffer 16.0 GiB"
    )
    assert "GPU cores unknown" in doctor.metal_line(True, lambda: info, lambda: None)
    assert doctor.metal_line(False, dict, lambda: None).startswith("not available")


def test_blas_line_says_how_to_get_openblas() -> None:
    missing = doctor.blas_line("linux", None, "no OpenBLAS found")
    assert "no OpenBLAS found" in missing and "pip install scipy-openblas32" in missing
    assert doctor.blas_line("linux", "/x/libopenblas.so.0", "OpenBLAS loaded") == "OpenBLAS loaded"
    assert doctor.blas_line("darwin", None, "-").startswith("Accelerate")


def test_kernel_self_tests_are_reported_per_variant() -> None:
    """A broken decode kernel (emulated): doctor names it FAILED, the others ok."""
    if sys.platform != "linux":
        pytest.skip("the Metal emulator runs on Linux")
    from metal.checker.emulator import Emulator
    from mlxserve.ops.metal import MetalKernels
    from tests.test_metal_selftest import broken

    kernels = MetalKernels(broken(Emulator(), "paged_decode", "wrong"))
    lines = doctor.kernel_lines(kernels, mx.float16, 64, 16, 3)
    assert len(lines) == 3
    verdicts = {line.split("<")[0].removeprefix("self-test:  "): line for line in lines}
    assert set(verdicts) == {
        "paged_decode",
        "paged_decode_split+paged_decode_reduce",
        "paged_prefill_tiled",
    }
    assert "T=float16, HEAD_DIM=64, BLOCK_SIZE=16, GQA=3" in verdicts["paged_decode"]
    assert "FAILED, using the fallback: mismatch" in verdicts["paged_decode"]
    for name, line in verdicts.items():
        if name != "paged_decode":
            assert line.endswith(": ok"), line
    assert doctor.kernel_lines(None, mx.float16, 64, 16, 3)[0].startswith("self-tests: not run")


def test_kernel_self_tests_of_8bit_pools_name_the_quantizing_variants() -> None:
    """kv_cache_dtype int8: the row quantization and KV_QUANT attention are self-tested; a
    wrong scale in the quantization (emulated) is reported FAILED."""
    if sys.platform != "linux":
        pytest.skip("the Metal emulator runs on Linux")
    from metal.checker.emulator import Emulator
    from mlxserve.ops.metal import MetalKernels

    emu = Emulator()

    def factory(**kw):
        if kw["name"] == "quantize_kv":  # the quantizer's step is in the shared header
            kw["header"] = kw["header"].replace("amax / 127.0f", "amax / 100.0f")
        return emu.metal_kernel(**kw)

    lines = doctor.kernel_lines(MetalKernels(factory), mx.float16, 64, 16, 3, kv_quant=True)
    assert len(lines) == 4
    assert lines[0].startswith("self-test:  quantize_kv<T=float16, HEAD_DIM=64>: FAILED")
    assert all("KV_QUANT=true" in line and line.endswith(": ok") for line in lines[1:]), lines


def test_a_failed_self_test_makes_the_exit_status_1(monkeypatch, capsys) -> None:
    """The whole command in-process, its kernels a broken emulated prefill (CI on a Mac
    relies on the status)."""
    if sys.platform != "linux":
        pytest.skip("the Metal emulator runs on Linux")
    from metal.checker.emulator import Emulator
    from mlxserve import ops
    from mlxserve.cli.main import build_parser
    from mlxserve.ops.metal import MetalKernels
    from tests.test_metal_selftest import broken

    kernels = MetalKernels(broken(Emulator(), "paged_prefill_tiled", "wrong"))
    monkeypatch.setattr(ops, "metal_kernels", lambda: kernels)
    args = build_parser().parse_args(["doctor", "--num-blocks", "65"])
    assert doctor.run_doctor(args) == 1
    out = capsys.readouterr().out
    assert "self-test:  paged_prefill_tiled<T=float32, HEAD_DIM=64" in out
    assert out.count(": FAILED") == 1


@pytest.mark.skipif(mx.metal.is_available(), reason="the CPU kernels line is for the CPU")
def test_doctor_says_why_cpu_kernels_are_off(monkeypatch) -> None:
    monkeypatch.setenv("MLXSERVE_CPU_KERNELS", "off")
    out = run_doctor(["--num-blocks", "65"])
    assert out.returncode == 0, out.stderr
    assert "cpu-qmm:    MLXSERVE_CPU_KERNELS=off" in out.stdout.splitlines()


def test_a_hybrid_model_is_reported_and_self_tested_per_kind_of_attention_layer() -> None:
    """Gemma-style sliding + global layers of other head sizes, an MLA-like layer (K and
    V head sizes differ) and a recurrent layer: one shape per kind, in layer order."""
    from types import SimpleNamespace

    from mlxserve.kv_cache_spec import FULL_ATTENTION, RECURRENT, SLIDING_WINDOW, LayerCacheSpec

    sliding = LayerCacheSpec(SLIDING_WINDOW, 4, 64, 64, window=512)
    full = LayerCacheSpec(FULL_ATTENTION, 2, 128, 128)
    mla = LayerCacheSpec(FULL_ATTENTION, 8, 24, 16)
    state = LayerCacheSpec(RECURRENT, state_shapes=((4, 8),), state_dtypes=("float32",))
    model = SimpleNamespace(cache_specs=(sliding, sliding, state, full, sliding, mla, full))
    assert doctor.attention_shapes(model, 8) == [
        (4, 64, 64, 512),
        (2, 128, 128, None),
        (8, 24, 16, None),
    ]
    plain = SimpleNamespace(num_kv_heads=3, head_dim=64)  # mlxserve's own llama: no specs
    assert doctor.attention_shapes(plain, 9) == [(3, 64, 64, None)]
