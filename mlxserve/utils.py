"""Leaf helpers shared across the wings: ceiling division, the device, usable memory, GPU cores.

Nothing here imports another mlxserve module, so any module may import it without
forming an import circle (the loader needs the device and memory without memory planning).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
import sys

GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def uses_gpu() -> bool:
    """True when MLX computes on a Metal GPU (asked per layer: cheap without Metal)."""
    if not _metal_available():
        return False
    import mlx.core as mx

    return mx.default_device() == mx.gpu


@functools.cache
def _metal_available() -> bool:
    import mlx.core as mx

    return mx.metal.is_available()


def usable_memory() -> int:
    """Bytes MLX may use: Metal's recommended working set, else physical RAM."""
    import mlx.core as mx

    if mx.metal.is_available():
        info = mx.device_info()
        return int(info.get("max_recommended_working_set_size") or info["memory_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_free_memory() -> None:
    """Give the OS back the memory nothing holds any more: MLX's buffer cache, then the free
    pages of the C heap (glibc's malloc_trim; elsewhere only the cache is cleared).

    Freed buffers go to MLX's cache and then to malloc, which keeps most of them: after
    loading a GGUF model (its converted tensors, the fused projections' inputs) a server
    would otherwise hold ~40 MB it never uses again (bench/README.md, peak RSS).
    """
    import mlx.core as mx

    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None


def gpu_core_count() -> int | None:
    """The GPU's core count from the IORegistry (macOS), or None (MLX does not report it)."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(
            ["ioreg", "-rc", "AGXAccelerator", "-d", "1"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', out)
    return int(m.group(1)) if m else None
