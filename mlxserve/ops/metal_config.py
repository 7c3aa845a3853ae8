"""Launch choices for the Metal kernels: the kernel table, MetalConfig, head groups, the
GPU's core count.

Nothing here has been measured on Apple hardware yet: the defaults follow the reasoning in
metal/README.md (split-K sized from the core count as MLX sizes its own 2-pass SDPA from
the device class; rows per threadgroup capped so registers do not grow with GQA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlxserve import settings
from mlxserve.exceptions import ParameterError

# Both prefill kernels (SIMT and tiled) take the same inputs.
PREFILL_INPUTS = [
    "q",
    "k_cache",
    "v_cache",
    "block_tables",
    "context_lens",
    "query_start_loc",
    "req_begin",
    "scale",
    "sinks",
]
# name -> (source file, input names, output names)
KERNELS = {
    "quantize_kv": (
        "quantize_kv.metal",
        ["keys", "values"],
        ["k_rows", "v_rows"],
    ),
    "paged_decode": (
        "paged_decode.metal",
        [
            "q",
            "k_cache",
            "v_cache",
            "block_tables",
            "context_lens",
            "scale",
            "sinks",
        ],
        ["out"],
    ),
    "paged_decode_split": (
        "paged_decode_split.metal",
        ["q", "k_cache", "v_cache", "block_tables", "context_lens", "scale"],
        ["partial_out", "partial_max", "partial_sum"],
    ),
    "paged_decode_reduce": (
        "paged_decode_reduce.metal",
        ["partial_out", "partial_max", "partial_sum", "context_lens", "sinks"],
        ["out"],
    ),
    "paged_prefill": (
        "paged_prefill.metal",
        PREFILL_INPUTS,
        ["out"],
    ),
    "paged_prefill_tiled": (
        "paged_prefill_tiled.metal",
        PREFILL_INPUTS,
        ["out"],
    ),
}
HEADER_FILE = "attention_common.metal"
# MLX binds inputs of fewer elements as `constant`, others as `device`: a different source.
# Metadata inputs are padded to this size, so a kernel's source never changes with the batch
# (before MLX 0.32 a changed source under the same kernel name evicted the compiled pipeline,
# and the self-test must verify the very source the batches run).
MIN_DEVICE_ELEMENTS = 8
# attention paths -> the kernels each launches
PATH_KERNELS = {
    "decode": "paged_decode",
    "split": "paged_decode_split+paged_decode_reduce",
    "prefill": "paged_prefill",
}
# Rows (query heads x query tokens) per threadgroup: attention_common.metal's MLXS_MAX_ROWS.
# Wider GQA groups are split into equal head groups, one threadgroup each.
MAX_ROWS = 8
# The simdgroup-matrix prefill (paged_prefill_tiled.metal): 4 simdgroups of 8 rows each.
TILED_SIMDGROUPS = 4
TILED_ROWS = 8 * TILED_SIMDGROUPS
PREFILL_KERNELS = ("tiled", "simt")
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
    # Varlen prefill: "tiled" (simdgroup matrices, 32-row tiles; head_dim a multiple of 8)
    # or "simt" (the first kernel, 8 rows per threadgroup). $MLXSERVE_METAL_PREFILL.
    prefill: str = field(default_factory=lambda: _prefill_choice())

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_KERNELS:
            raise ParameterError(
                f"prefill (MLXSERVE_METAL_PREFILL) must be one of {PREFILL_KERNELS}, "
                f"got {self.prefill!r}",
                parameter="prefill",
            )


def _prefill_choice() -> str:
    return settings.current().metal_prefill


def head_groups(gqa: int, rows: int = MAX_ROWS) -> tuple[int, int]:
    """(threadgroups per KV head, query heads in each) for a GQA group of `gqa` heads and at
    most `rows` rows per threadgroup: MLXS_HEAD_GROUPS and MLXS_GROUP_HEADS of
    attention_common.metal (HG and GH of paged_prefill_tiled.metal with TILED_ROWS)."""
    groups = -(-gqa // rows)
    return groups, -(-gqa // groups)


def prefill_tile_tokens(gqa: int, tiled: bool = False) -> int:
    """Query tokens per prefill tile (TQ): as many as fit the rows of a threadgroup (8, or
    32 for the tiled kernel) with a head group."""
    rows = TILED_ROWS if tiled else MAX_ROWS
    return max(1, rows // head_groups(gqa, rows)[1])


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
