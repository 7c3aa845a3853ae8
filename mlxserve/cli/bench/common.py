"""Shared by the bench sub-commands and bench/ scripts: child processes, the peers' model
preparation, the cache folder, percentiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# The folder holding the mlxserve package imported here (a checkout, or site-packages):
# child processes put it first on their path so they run this same mlxserve.
PACKAGE_ROOT = Path(__file__).resolve().parents[3]

# MLX's own BLAS for mlx-lm's "stock" runs: mlxserve must not leak its OpenBLAS choice.
STOCK_ENV = {"MLXSERVE_BLAS": "off", "LD_PRELOAD": ""}
# Run by its path, not as a module: importing mlxserve first would bind its BLAS for mlx-lm.
MLX_LM_WORKER = Path(__file__).with_name("mlx_lm_worker.py")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxserve-bench"


def openblas_env(blas: str | None) -> dict[str, str]:
    """mlx-lm with the OpenBLAS mlxserve binds, bound the same way (mlxserve/cpu/blas.py)."""
    return {"BENCH_BIND_BLAS": "1", "MLXSERVE_BLAS": blas or "off", "LD_PRELOAD": ""}


def run_mlx_lm_offline(spec: dict, env: dict[str, str], work: Path, name: str) -> dict:
    """Run mlx_lm_worker.py on ``spec`` in a child process; its results."""
    spec_path, out = work / f"{name}-spec.json", work / f"{name}-offline.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(MLX_LM_WORKER), str(spec_path), str(out)]
    return run_json(cmd, child_env(env), out)


def find_openblas() -> str | None:
    """The OpenBLAS mlxserve binds by default (PyPI's, else the system's), to give mlx-lm too."""
    from mlxserve.cpu.blas import pypi_openblas, system_openblas

    return pypi_openblas() or system_openblas()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=path)
    env.update(extra or {})
    if env.get("LD_PRELOAD") == "":
        env.pop("LD_PRELOAD")
    return env


def mlx_lm_model(model: str | None, variant: str, log=print) -> Path:
    """MODEL as an mlx-lm directory, converted once and cached.

    variant "q": the same quantized weights, scales and biases in float32 (exact; MLX's
    CPU quantized matmul is ~10x slower with the float16 scales a GGUF has), which is
    mlx-lm's fastest quantized setting on the CPU; on Metal it keeps float16.
    variant "f32": the same values dequantized to float32 (for runs with OpenBLAS).
    """
    import mlx.core as mx

    from mlxserve.cli.convert import convert
    from mlxserve.loader import resolve_model

    source = resolve_model(model)
    on_gpu = mx.metal.is_available()
    tag = f"{source.path.stem}-{source.path.stat().st_size}-{variant}{'-gpu' if on_gpu else ''}"
    out = cache_dir() / "models" / tag
    if (out / "config.json").exists():
        return out
    log(f"[bench] converting {source.path.name} for mlx-lm ({variant}) -> {out}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    convert(model, tmp)
    path = tmp / "model.safetensors"
    weights = mx.load(str(path))
    config = json.loads((tmp / "config.json").read_text())
    if variant == "f32":
        weights = _dequantize(weights, config)
        config.pop("quantization", None)
    elif not on_gpu:
        weights = {
            k: v.astype(mx.float32) if k.endswith((".scales", ".biases")) else v
            for k, v in weights.items()
        }
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out


def _dequantize(weights: dict, config: dict) -> dict:
    import mlx.core as mx

    quant = config.get("quantization") or {}
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")]
        if name.endswith(".weight") and f"{base}.scales" in weights:
            q = quant.get(base) if isinstance(quant.get(base), dict) else quant
            w = mx.dequantize(
                w,
                weights[f"{base}.scales"],
                weights[f"{base}.biases"],
                q.get("group_size", 64),
                q.get("bits", 4),
            )
        out[name] = w.astype(mx.float32) if mx.issubdtype(w.dtype, mx.floating) else w
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def run_json(cmd: list[str], env: dict[str, str], out_path: Path, log=print) -> dict:
    """Run a worker that writes JSON to out_path; its output goes to our stdout."""
    log(f"[bench] {' '.join(str(c) for c in cmd)}")
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out_path.read_text())
