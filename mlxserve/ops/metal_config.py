"""Launch choices for the Metal kernels: MetalConfig, head groups, the GPU's core count.

Nothing here has been measured on Apple hardware yet: the defaults follow the reasoning in
metal/README.md (split-K sized from the core count as MLX sizes its own 2-pass SDPA from
the device class; rows per threadgroup capped so registers do not grow with GQA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

# Rows (query heads x query tokens) per threadgroup: attention_common.metal's MLXS_MAX_ROWS.
# Wider GQA groups are split into equal head groups, one threadgroup each.
MAX_ROWS = 8
# GPU cores assumed when the machine does not say (no Metal, ioreg unavailable): Apple's
# base M-series GPUs have 8-10, by the architecture letter MLX reads (device.cpp) the
# larger ones more. Estimates by class only where the exact count is unknown.
DEFAULT_GPU_CORES = 10
CORES_BY_ARCH_CLASS = {"p": 5, "g": 10, "s": 32, "d": 64}


@dataclass(frozen=True)
class MetalConfig:
    """Launch choices; the defaults are for Apple GPUs (none measured on one yet).

    Split-K: decodes are split into partitions of `partition_size` tokens when their
    threadgroups (decodes x KV heads x head groups) number fewer than `groups_per_core`
    per GPU core, so a small batch still fills the GPU, and the longest attended context
    is at least `split_min_context`. This holds for the decodes of a mixed step too.
    `gpu_cores` None asks the machine (gpu_cores()).
    """

    num_simd: int = 4  # simdgroups per threadgroup (raised to cover head_dim)
    partition_size: int = 256  # tokens per split-K partition
    split_min_context: int = 512  # split only contexts of at least two partitions
    groups_per_core: int = 4  # threadgroups per GPU core below which decodes are split
    gpu_cores: int | None = None  # None: from the device (gpu_cores())


def head_groups(gqa: int) -> tuple[int, int]:
    """(threadgroups per KV head, query heads in each) for a GQA group of `gqa` heads:
    MLXS_HEAD_GROUPS and MLXS_GROUP_HEADS of attention_common.metal."""
    groups = -(-gqa // MAX_ROWS)
    return groups, -(-gqa // groups)


def prefill_tile_tokens(gqa: int) -> int:
    """Query tokens per prefill tile (TQ): as many as fit MAX_ROWS rows with a head group."""
    return max(1, MAX_ROWS // head_groups(gqa)[1])


def gpu_cores(
    available: Callable[[], bool] | None = None,
    ioreg_cores: Callable[[], int | None] | None = None,
    device_info: Callable[[], dict] | None = None,
) -> tuple[int, str]:
    """(GPU cores, where the number comes from): the IORegistry's exact count on macOS, else
    an estimate from the architecture class in mx.metal.device_info() (MLX reports no core
    count), else DEFAULT_GPU_CORES. The callables are injectable for tests."""
    from mlxserve.utils import gpu_core_count

    available = available or mx.metal.is_available
    if not available():
        return DEFAULT_GPU_CORES, "default (no Metal device)"
    n = (ioreg_cores or gpu_core_count)()
    if n:
        return n, "IORegistry gpu-core-count"
    arch = str((device_info or mx.device_info)().get("architecture", ""))
    if arch[-1:] in CORES_BY_ARCH_CLASS:
        return CORES_BY_ARCH_CLASS[arch[-1]], f"estimated from architecture {arch}"
    return DEFAULT_GPU_CORES, f"default (architecture {arch or '?'} not known)"
