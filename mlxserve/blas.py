"""An optimized BLAS under MLX's CPU backend on Linux (optional, measured, reversible).

MLX's Linux CPU wheel links a reference BLAS (~2-3 GFLOP/s for float32 matmul).
libmlx resolves ``cblas_sgemm`` dynamically, and a library loaded with RTLD_GLOBAL
before libmlx comes first in the symbol search; so loading OpenBLAS before
``import mlx`` makes every float32 matmul use it (~40 GFLOP/s measured on 2 cores).

    MLXSERVE_BLAS=auto (default)  load a system OpenBLAS if one is found (Linux only)
    MLXSERVE_BLAS=off             keep MLX's bundled BLAS
    MLXSERVE_BLAS=/path/libopenblas.so.0   load this one

On Debian/Ubuntu: ``apt install libopenblas0-pthread``. On macOS nothing happens: MLX
uses Accelerate on the CPU and Metal on the GPU.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblaso.so.0",
    "/usr/lib/libopenblas.so.0",
]

_state: dict[str, str | None] = {"path": None, "reason": "not attempted"}


def _find() -> str | None:
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    found = sorted(glob.glob("/usr/lib/*/openblas*/libopenblas*.so*"))
    return found[0] if found else None


def preload() -> None:
    """Load OpenBLAS globally if allowed and possible; must run before ``import mlx``."""
    if _state["reason"] != "not attempted":
        return
    choice = os.environ.get("MLXSERVE_BLAS", "auto").strip()
    if sys.platform != "linux":
        _state["reason"] = "not Linux: MLX's own BLAS (Accelerate) is used"
        return
    if choice.lower() in ("off", "0", "no", "false", "none"):
        _state["reason"] = "MLXSERVE_BLAS=off"
        return
    if "mlx.core" in sys.modules:
        _state["reason"] = "mlx was imported before mlxserve, so its BLAS is already bound"
        return
    path = _find() if choice.lower() in ("", "auto") else choice
    if path is None:
        _state["reason"] = "no OpenBLAS found (apt install libopenblas0-pthread)"
        return
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        lib.cblas_sgemm  # noqa: B018 -- raises AttributeError if the symbol is missing
    except (OSError, AttributeError) as e:
        _state["reason"] = f"could not load {path}: {e}"
        return
    _state["path"] = path
    _state["reason"] = f"OpenBLAS loaded from {path}"


def fast_blas() -> str | None:
    """Path of the optimized BLAS MLX's float32 matmuls use, or None."""
    return _state["path"]


def blas_status() -> str:
    """One line saying which BLAS MLX uses on the CPU, and why."""
    return str(_state["reason"])
