"""Process-wide backend settings: the one place mlxserve reads its ``MLXSERVE_*`` variables.

These choose how this process runs MLX's CPU and Metal backends (which BLAS is bound, the
CPU kernels, int8 activations, the Metal prefill kernel). They are process-wide because
what they choose is: one BLAS is bound under libmlx, one CPU-kernel extension is loaded.
Each field's default is its environment variable; :func:`current` gives the settings in
force (those :func:`use` installed, else the environment's, read and validated when
asked), and ``mlxserve doctor`` prints them. The engine settings of one model (block size,
kernels, ...) are :class:`mlxserve.config.EngineConfig`'s.

It imports only leaves (the exception type, cpu/blas.py), so the lower layers that need
a setting (cpu, loader, ops) can ask without an import circle; blas, itself a leaf, is
handed its settings by :func:`start`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields

from mlxserve.cpu import blas
from mlxserve.exceptions import ParameterError

__all__ = ["ENV", "Settings", "current", "describe", "start", "use"]

_OFF = ("off", "0", "no", "false", "none")
_ON = ("on", "1", "yes", "true")
CPU_INT8_CHOICES = ("auto", "on", "off")
METAL_PREFILL_CHOICES = ("tiled", "simt")

# field -> the environment variable that gives its default
ENV = {
    "blas": "MLXSERVE_BLAS",
    "blas_gemv": "MLXSERVE_BLAS_GEMV",
    "cpu_kernels": "MLXSERVE_CPU_KERNELS",
    "cpu_threads": "MLXSERVE_CPU_THREADS",
    "cpu_int8": "MLXSERVE_CPU_INT8",
    "cpu_dequantize": "MLXSERVE_CPU_DEQUANTIZE",
    "metal_prefill": "MLXSERVE_METAL_PREFILL",
}


@dataclass(frozen=True)
class Settings:
    """How this process runs MLX's backends; each default is an ``MLXSERVE_*`` variable."""

    # OpenBLAS under MLX's CPU backend (Linux): "auto" (PyPI's, else the system's), "off",
    # or a library path (mlxserve/cpu/blas.py).
    blas: str = "auto"
    # one-row float32 matmuls through sgemv (a small compiled shim; mlxserve/cpu/blas.py)
    blas_gemv: bool = True
    # mlxserve's CPU kernels for quantized layers (mlxserve/cpu), built on first use
    cpu_kernels: bool = True
    # threads per CPU-kernel call; None: this process's CPUs
    cpu_threads: int | None = None
    # int8 activations in the CPU kernels: "auto" (where an integer SIMD path exists), on, off
    cpu_int8: str = "auto"
    # without the CPU kernels, run small quantized models dequantized through OpenBLAS
    cpu_dequantize: bool = True
    # Metal prefill kernel: "tiled" (simdgroup matrices) or "simt"
    metal_prefill: str = "tiled"

    def __post_init__(self) -> None:
        if self.cpu_int8 not in CPU_INT8_CHOICES:
            raise ParameterError(
                f"{ENV['cpu_int8']} must be auto, on or off, got {self.cpu_int8!r}",
                ENV["cpu_int8"],
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ParameterError(
                f"{ENV['cpu_threads']} must be a positive number of threads, "
                f"got {self.cpu_threads!r}",
                ENV["cpu_threads"],
            )
        if not self.blas.strip():
            raise ParameterError(f"{ENV['blas']} must be auto, off or a path", ENV["blas"])
        # metal_prefill is checked by ops.metal_config.MetalConfig, at start-up
        # (ops.check_kernels), where the Metal launch settings are validated together.

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the environment gives (unset variables keep the defaults)."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, var in ENV.items():
            text = env.get(var, "").strip()
            if not text:
                continue
            if name in ("blas_gemv", "cpu_kernels", "cpu_dequantize"):
                values[name] = text.lower() not in _OFF
            elif name == "cpu_threads":
                try:
                    values[name] = int(text)
                except ValueError:
                    raise ParameterError(
                        f"{var} must be a positive number of threads, got {text!r}", var
                    ) from None
            elif name == "cpu_int8":
                lowered = text.lower()
                values[name] = "off" if lowered in _OFF else "on" if lowered in _ON else lowered
            elif name == "blas":
                values[name] = "off" if text.lower() in _OFF else text
            else:
                values[name] = text.lower()
        return cls(**values)  # type: ignore[arg-type]


_installed: list[Settings] = []


def current() -> Settings:
    """The settings in force: the innermost :func:`use`'s, else the environment's."""
    return _installed[-1] if _installed else Settings.from_env()


@contextmanager
def use(settings: Settings) -> Iterator[Settings]:
    """Run the block with ``settings`` instead of the environment's (tests, embedders)."""
    _installed.append(settings)
    try:
        yield settings
    finally:
        _installed.pop()


def describe(settings: Settings | None = None) -> list[str]:
    """One ``field=value (VARIABLE)`` item per setting, for ``mlxserve doctor``."""
    settings = current() if settings is None else settings
    default = Settings()
    out = []
    for f in fields(settings):
        value = getattr(settings, f.name)
        mark = "" if value == getattr(default, f.name) else " *"
        out.append(f"{f.name}={value} ({ENV[f.name]}){mark}")
    return out


def start() -> Settings:
    """Apply what must take effect before a model runs (bind the BLAS under MLX); called
    when a model is loaded and when a command starts, never on import. Returns the settings."""
    settings = current()
    blas.preload(settings.blas, settings.blas_gemv)
    return settings
