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

OpenBLAS's sgemm packs the whole weight matrix even for one row of activations, so a
single decoding request runs ~3-4x below memory bandwidth. ``csrc/sgemm_gemv.c`` is a
``cblas_sgemm`` that hands one-row products to ``cblas_sgemv`` and everything else to
OpenBLAS; it is compiled once with the system C compiler into a cache folder and loaded
ahead of OpenBLAS:

    MLXSERVE_BLAS_GEMV=auto (default)  use it when OpenBLAS is loaded and cc/gcc exists
    MLXSERVE_BLAS_GEMV=off             plain OpenBLAS sgemm for every shape
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblaso.so.0",
    "/usr/lib/libopenblas.so.0",
]

_state: dict[str, str | None] = {
    "path": None,
    "reason": "not attempted",
    "gemv": None,
    "gemv_reason": "not attempted",
}
_OFF = ("off", "0", "no", "false", "none")
_SHIM_SOURCE = Path(__file__).with_name("csrc") / "sgemm_gemv.c"


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
    if choice.lower() in _OFF:
        _state["reason"] = "MLXSERVE_BLAS=off"
        return
    if "mlx.core" in sys.modules:
        _state["reason"] = "mlx was imported before mlxserve, so its BLAS is already bound"
        return
    path = _find() if choice.lower() in ("", "auto") else choice
    if path is None:
        _state["reason"] = "no OpenBLAS found (apt install libopenblas0-pthread)"
        return
    try:  # first privately: a bad path must not leave the shim bound to nothing
        lib = ctypes.CDLL(path)
        sgemm, sgemv = lib.cblas_sgemm, lib.cblas_sgemv  # AttributeError if missing
    except (OSError, AttributeError) as e:
        _state["reason"] = f"could not load {path}: {e}"
        return
    # The first RTLD_GLOBAL library defining cblas_sgemm is the one libmlx binds: the
    # shim, then OpenBLAS (reopening promotes it to global scope, after the shim).
    shim = _load_gemv_shim()
    if shim is not None:
        as_ptr = ctypes.cast
        shim.mlxserve_bind(as_ptr(sgemm, ctypes.c_void_p), as_ptr(sgemv, ctypes.c_void_p))
        _state["gemv"] = shim._name
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _state["path"] = path
    _state["reason"] = f"OpenBLAS loaded from {path}"


def _load_gemv_shim() -> ctypes.CDLL | None:
    """Compile (once, cached) and load csrc/sgemm_gemv.c, or None saying why not."""
    if os.environ.get("MLXSERVE_BLAS_GEMV", "auto").strip().lower() in _OFF:
        _state["gemv_reason"] = "MLXSERVE_BLAS_GEMV=off"
        return None
    try:
        path = _build_shim()
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        _state["gemv_reason"] = f"not built: {e}"
        return None
    try:
        shim = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _state["gemv_reason"] = f"could not load {path}: {e}"
        return None
    _state["gemv_reason"] = f"one-row sgemm calls go to sgemv ({path})"
    return shim


def shim_cache_dir() -> Path:
    """Where the compiled shim is kept ($XDG_CACHE_HOME/mlxserve, else ~/.cache/mlxserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxserve" / "blas"


def _build_shim() -> Path:
    source = _SHIM_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    out = shim_cache_dir() / f"sgemm_gemv-{digest}.so"
    if out.exists():
        return out
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-shared", "-fPIC", str(_SHIM_SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
    return out


def fast_blas() -> str | None:
    """Path of the optimized BLAS MLX's float32 matmuls use, or None."""
    return _state["path"]


def gemv_shim() -> str | None:
    """Path of the loaded sgemm -> sgemv shim (one-row matmuls), or None."""
    return _state["gemv"]


def blas_status() -> str:
    """One line saying which BLAS MLX uses on the CPU, and why."""
    if _state["path"] is None:
        return str(_state["reason"])
    return f"{_state['reason']}; {_state['gemv_reason']}"
