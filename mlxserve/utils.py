"""Leaf helpers shared across the wings: ceiling division, the device, usable memory, GPU cores.

Nothing here imports another mlxserve module, so any module may import it without
forming an import circle (the loader needs the device and memory without memory planning).
"""

from __future__ import annotations

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
