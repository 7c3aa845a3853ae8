"""Split-K decode: chosen from the GPU's core count, for decode-only and mixed batches."""

from __future__ import annotations

import pytest

from metal.checker.record import Recorder
from mlxserve.ops import AttentionMetadata
from mlxserve.ops.metal import MetalKernels
from mlxserve.ops.metal_config import (
    DEFAULT_GPU_CORES,
    MetalConfig,
    gpu_cores,
    head_groups,
    prefill_tile_tokens,
)


def _md(requests: list[tuple[int, int]], block_size: int = 16) -> AttentionMetadata:
    tables, next_block = [], 1
    for _, ctx in requests:
        n = -(-ctx // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return AttentionMetadata.build(
        [q for q, _ in requests], [c for _, c in requests], tables, block_size
    )


def _kernels(cores: int, **config) -> MetalKernels:
    return MetalKernels(Recorder().metal_kernel, MetalConfig(gpu_cores=cores, **config))


@pytest.mark.parametrize(
    "cores,decodes,kv_heads,gqa,context,split",
    [
        (10, 2, 8, 4, 2000, True),  # 16 threadgroups < 40
        (10, 5, 8, 4, 2000, False),  # 40: the GPU is full without splitting
        (80, 5, 8, 4, 2000, True),  # an Ultra-sized GPU still wants more
        (10, 2, 8, 4, 511, False),  # shorter than two partitions of 256
        (10, 2, 8, 4, 512, True),
        (10, 3, 4, 16, 2000, True),  # 3 x 4 x 2 head groups = 24 < 40
        (10, 5, 4, 16, 2000, False),  # 5 x 4 x 2 = 40
        (10, 1, 1, 8, 4096, True),  # multi-query, one request
    ],
)
def test_decodes_split_while_the_gpu_is_not_full(
    cores, decodes, kv_heads, gqa, context, split
) -> None:
    kernels = _kernels(cores)
    md = _md([(1, context)] * decodes)
    assert kernels.attention_paths(md, kv_heads, gqa, None) == (
        ("split",) if split else ("decode",)
    )
    mixed = _md([(1, context)] * decodes + [(30, 100)])
    assert kernels.attention_paths(mixed, kv_heads, gqa, None) == (
        ("split", "prefill") if split else ("prefill",)
    )


def test_a_window_counts_the_tokens_it_attends() -> None:
    kernels = _kernels(10)
    md = _md([(1, 4000)])
    assert kernels.attention_paths(md, 8, 4, 511) == ("decode",)
    assert kernels.attention_paths(md, 8, 4, 512) == ("split",)
    assert kernels.attention_paths(_md([(20, 4000)]), 8, 4, None) == ("prefill",)  # no decodes


def test_gpu_cores_come_from_the_device() -> None:
    def never():
        raise AssertionError("not asked when Metal is missing")

    assert gpu_cores(lambda: False, never, never) == (
        DEFAULT_GPU_CORES,
        "default (no Metal device)",
    )
    assert gpu_cores(lambda: True, lambda: 38, never) == (38, "IORegistry gpu-core-count")
    info = {"architecture": "applegpu_g15d"}
    assert gpu_cores(lambda: True, lambda: None, lambda: info) == (
        64,
        "estimated from architecture applegpu_g15d",
    )
    n, source = gpu_cores(lambda: True, lambda: None, lambda: {"architecture": "applegpu_x1"})
    assert n == DEFAULT_GPU_CORES and "not known" in source
    kernels = _kernels(24)
    assert (kernels.gpu_cores, kernels.gpu_cores_source) == (24, "configured")


@pytest.mark.parametrize(
    "gqa,groups,heads,tq",
    [
        (1, 1, 1, 8),
        (3, 1, 3, 2),
        (8, 1, 8, 1),
        (9, 2, 5, 1),
        (12, 2, 6, 1),
        (16, 2, 8, 1),
        (17, 3, 6, 1),
        (64, 8, 8, 1),
    ],
)
def test_rows_per_threadgroup_are_capped(gqa, groups, heads, tq) -> None:
    """A GQA group wider than 8 rows is split into equal head groups (hand-computed)."""
    assert head_groups(gqa) == (groups, heads)
    assert prefill_tile_tokens(gqa) == tq
    assert heads * tq <= 8


def test_max_rows_matches_the_kernels_header() -> None:
    import re

    from mlxserve.ops.metal import HEADER_FILE, read_source
    from mlxserve.ops.metal_config import MAX_ROWS

    m = re.search(r"#define MLXS_MAX_ROWS (\d+)", read_source(HEADER_FILE))
    assert m and int(m.group(1)) == MAX_ROWS


def test_the_prefill_kernel_is_selectable(monkeypatch) -> None:
    """The simdgroup-matrix prefill by default, the SIMT one on request or when head_dim is
    not a multiple of 8; a bad choice is a ParameterError at start-up."""
    from mlxserve import ops
    from mlxserve.exceptions import ParameterError

    monkeypatch.delenv("MLXSERVE_METAL_PREFILL", raising=False)
    assert _kernels(10).prefill_kernel(128) == "paged_prefill_tiled"
    assert _kernels(10).prefill_kernel(36) == "paged_prefill"
    assert _kernels(10, prefill="simt").prefill_kernel(128) == "paged_prefill"
    monkeypatch.setenv("MLXSERVE_METAL_PREFILL", " SIMT")
    assert MetalConfig().prefill == "simt"
    monkeypatch.setenv("MLXSERVE_METAL_PREFILL", "fast")
    with pytest.raises(ParameterError, match=r"MLXSERVE_METAL_PREFILL.*'fast'") as e:
        ops.check_kernels("auto")
    assert e.value.parameter == "prefill"
    ops.check_kernels("fallback")  # the fallback launches no Metal kernel
