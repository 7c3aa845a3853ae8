"""Mutation tests: known bugs injected into copies of the kernels must all be caught.

Each mutation edits one kernel source as mlxserve loads it (the original must contain the
edited text exactly once), runs the ops on the emulator under two thread schedules, and
compares with the fallback exactly as the sweep in test_metal_kernels.py does. The test
asserts how the checker catches it: a numerical mismatch, NaN from a poisoned buffer, a race
(schedule-dependent result), a divergence/deadlock report, or an invalid memory access.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest

from metal.checker.build import CompileError
from metal.checker.cases import (
    Case,
    check,
    decode_requests,
    metal_backend,
    mixed_requests,
    split_config,
)
from metal.checker.emulator import Emulator, KernelError
from mlxserve.ops.metal import read_source
from mlxserve.ops.metal_config import MetalConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulator runs on Linux")

BS = 8


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    paths: tuple[str, ...]  # decode | split | prefill
    caught_by: str  # mismatch | nan | race | divergence | fault
    windowed: bool = False  # run the case with a sliding window and attention sinks
    gqa: int = 2  # query heads per KV head (> 8: several head groups per KV head)
    kv_quant: bool = False  # 8-bit pools (--kv-cache-dtype int8)


HEADER = "attention_common.metal"
ALL = ("decode", "split", "prefill")
LANE_EXIT = "if (lane == 31) { return; }\n"
MUTATIONS = [
    # shared attention helpers
    Mutation(
        "attention: barrier removed before the merge reads",
        HEADER,
        "threadgroup_barrier(mem_flags::mem_threadgroup);\n  float out = 0.0f;",
        "float out = 0.0f;",
        ALL,
        "race",
    ),
    Mutation(
        "attention: barrier removed before the merge buffer is reused",
        HEADER,
        "threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_acc is reused",
        "//",
        ALL,
        "race",
    ),
    Mutation(
        "attention: barrier removed after publishing stats",
        HEADER,
        "  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n}",
        "  }\n}",
        ALL,
        "race",
    ),
    Mutation(
        "attention: wrong block-table index",
        HEADER,
        "const int64_t block = table[b];",
        "const int64_t block = table[b > 0 ? b - 1 : 0];",
        ALL,
        "mismatch",
    ),
    Mutation(
        "attention: off-by-one offset inside the block",
        HEADER,
        "(block * BLOCK_SIZE + (t - b_first))",
        "(block * BLOCK_SIZE + (t + 1 - b_first) % BLOCK_SIZE)",
        ALL,
        "mismatch",
    ),
    Mutation(
        "attention: every simdgroup starts at the first block",
        HEADER,
        "b = t_begin / BLOCK_SIZE + int(simd);",
        "b = t_begin / BLOCK_SIZE;",
        ALL,
        "mismatch",
    ),
    Mutation(
        "attention: simdgroups stride over too few blocks",
        HEADER,
        "b += NUM_SIMD)",
        "b += NUM_SIMD - 1)",
        ("decode",),  # the only case whose contexts span more blocks than simdgroups
        "mismatch",
    ),
    Mutation(
        "attention: lanes skip the last head dims",
        HEADER,
        "v[i] = d < HEAD_DIM ?",
        "v[i] = d < HEAD_DIM - 8 ?",
        ALL,
        "mismatch",
    ),
    # sliding window and attention sinks
    Mutation(
        "attention: window one token too wide",
        HEADER,
        "max(pos + 1 - WINDOW, 0)",
        "max(pos - WINDOW, 0)",
        (*ALL, "tiled"),
        "mismatch",
        windowed=True,
    ),
    Mutation(
        "attention: sink left out of the denominator",
        HEADER,
        "(row_sum * f + metal::fast::exp(sink - m))",
        "(row_sum * f)",
        (*ALL, "tiled"),
        "mismatch",
        windowed=True,
    ),
    Mutation(
        "decode: every head takes its group's first sink",
        "paged_decode.metal",
        "sinks[kv_head * GQA + head0 + r]",
        "sinks[kv_head * GQA]",
        ("decode",),
        "mismatch",
        windowed=True,
    ),
    Mutation(
        "prefill: every head takes its group's first sink",
        "paged_prefill.metal",
        "sinks[kv_head * GQA + g]",
        "sinks[kv_head * GQA]",
        ("prefill",),
        "mismatch",
        windowed=True,
    ),
    Mutation(
        "reduce: reads the partitions the window skipped",
        "paged_decode_reduce.metal",
        "const int p_first = window_first<WINDOW>(context_lens[row] - 1) / PARTITION_SIZE;",
        "const int p_first = 0;",
        ("split",),
        "nan",
        windowed=True,
    ),
    # decode
    Mutation(
        "decode: wrong GQA head mapping",
        "paged_decode.metal",
        "(int64_t(req) * num_heads + kv_head * GQA + head0 + r) * HEAD_DIM",
        "(int64_t(req) * num_heads + r * num_kv_heads + kv_head) * HEAD_DIM",
        ("decode",),
        "mismatch",
    ),
    Mutation(
        "decode: early lane exit",
        "paged_decode.metal",
        "publish_stats<ROWS",
        LANE_EXIT + "publish_stats<ROWS",
        ("decode",),
        "divergence",
    ),
    Mutation(
        "decode: a second head group reads the first group's queries",
        "paged_decode.metal",
        "(int64_t(req) * num_heads + kv_head * GQA + head0 + r) * HEAD_DIM",
        "(int64_t(req) * num_heads + kv_head * GQA + r) * HEAD_DIM",
        ("decode",),
        "mismatch",
        gqa=12,
    ),
    Mutation(
        "decode: last context token dropped",
        "paged_decode.metal",
        "limit[r] = r < rows ? ctx : 0;",
        "limit[r] = r < rows ? ctx - 1 : 0;",
        ("decode",),
        "nan",  # context 1: nothing left to attend, 0/0
    ),
    Mutation(
        "decode: padding rows left unwritten",
        "paged_decode.metal",
        "out_rows[i] = T(0.0f);",
        "(void)i;",
        ("decode",),
        "nan",
    ),
    # split-K decode
    Mutation(
        "split: partition ends one token early",
        "paged_decode_split.metal",
        "t_first + PARTITION_SIZE);",
        "t_first + PARTITION_SIZE - 1);",
        ("split",),
        "mismatch",
    ),
    Mutation(
        "split: wrong GQA head mapping",
        "paged_decode_split.metal",
        "(int64_t(req) * num_heads + kv_head * GQA + head0 + r) * num_parts",
        "(int64_t(req) * num_heads + r * num_kv_heads + kv_head) * num_parts",
        ("split",),
        "mismatch",
    ),
    Mutation(
        "split: a second head group reads the first group's queries",
        "paged_decode_split.metal",
        "(int64_t(req) * num_heads + kv_head * GQA + head0 + r) * HEAD_DIM",
        "(int64_t(req) * num_heads + kv_head * GQA + r) * HEAD_DIM",
        ("split",),
        "mismatch",
        gqa=12,
    ),
    Mutation(
        "split: early lane exit",
        "paged_decode_split.metal",
        "publish_stats<ROWS",
        LANE_EXIT + "publish_stats<ROWS",
        ("split",),
        "divergence",
    ),
    Mutation(
        "reduce: last partial partition dropped",
        "paged_decode_reduce.metal",
        "(context_lens[row] + PARTITION_SIZE - 1) / PARTITION_SIZE",
        "context_lens[row] / PARTITION_SIZE",
        ("split",),
        "nan",  # a context shorter than one partition keeps no partition: 0/0
    ),
    Mutation(
        "reduce: reads partitions nobody wrote",
        "paged_decode_reduce.metal",
        "metal::min(num_parts, (context_lens[row] + PARTITION_SIZE - 1) / PARTITION_SIZE)",
        "num_parts",
        ("split",),
        "nan",
    ),
    Mutation(
        "reduce: early exit skips the last dim",
        "paged_decode_reduce.metal",
        "if (d >= HEAD_DIM) {",
        "if (d >= HEAD_DIM - 1) {",
        ("split",),
        "nan",
    ),
    # varlen prefill
    Mutation(
        "prefill: causal mask off by one",
        "paged_prefill.metal",
        "first_pos + j + 1 : 0",
        "first_pos + j + 2 : 0",
        ("prefill",),
        "mismatch",
    ),
    Mutation(
        "prefill: tile covers one query too few",
        "paged_prefill.metal",
        "count = metal::min(TQ, q_begin",
        "count = metal::min(TQ - 1, q_begin",
        ("prefill",),
        "nan",
    ),
    Mutation(
        "prefill: wrong GQA head mapping",
        "paged_prefill.metal",
        "(int64_t(first + j) * num_heads + kv_head * GQA + g) * HEAD_DIM + tid",
        "(int64_t(first + j) * num_heads + g * num_kv_heads + kv_head) * HEAD_DIM + tid",
        ("prefill",),
        "mismatch",
    ),
    Mutation(
        "prefill: every head group takes the first group's heads",
        "paged_prefill.metal",
        "% HG) * GH;",
        "% HG) * 0;",
        ("prefill",),
        "nan",  # the second group's heads are never written
        gqa=12,
    ),
    Mutation(
        "prefill: early lane exit",
        "paged_prefill.metal",
        "publish_stats<ROWS",
        LANE_EXIT + "publish_stats<ROWS",
        ("prefill",),
        "divergence",
    ),
    Mutation(
        "prefill: another request's block table",
        "paged_prefill.metal",
        "block_tables + int64_t(req) * max_blocks",
        "block_tables + int64_t(req + 1) * max_blocks",
        ("prefill",),
        "fault",
    ),
    # 8-bit pools (--kv-cache-dtype int8): the row quantization and the dequantizing reads
    Mutation(
        "quantize_kv: V rows quantized from the keys",
        "quantize_kv.metal",
        "quantize_row<HEAD_DIM>(values + row * HEAD_DIM",
        "quantize_row<HEAD_DIM>(keys + row * HEAD_DIM",
        ("decode",),
        "mismatch",
        kv_quant=True,
    ),
    Mutation(
        "quantize_kv: K rows one token off",
        "quantize_kv.metal",
        "k_rows + row * MLXS_KV_ROW(HEAD_DIM, true)",
        "k_rows + (row + 1) * MLXS_KV_ROW(HEAD_DIM, true)",
        ("prefill",),
        "fault",
        kv_quant=True,
    ),
    Mutation(
        "quantize_row: the row's max not reduced across lanes",
        HEADER,
        "amax = metal::simd_max(amax);",
        "",
        ("decode",),
        "mismatch",
        kv_quant=True,
    ),
    Mutation(
        "quantize_row: a wrong scale (max / 128)",
        HEADER,
        "const float scale = amax / 127.0f;",
        "const float scale = amax / 128.0f;",
        ("decode",),
        "mismatch",
        kv_quant=True,
    ),
    Mutation(
        "attention: the K scale not applied to the score",
        HEADER,
        "metal::simd_sum(partial) * k_scale;",
        "metal::simd_sum(partial);",
        ("decode", "split", "prefill"),
        "mismatch",
        kv_quant=True,
    ),
    Mutation(
        "attention: V weighted by the K row's scale",
        HEADER,
        "const float pv = p * v_scale;",
        "const float pv = p * k_scale;",
        ("decode", "split", "prefill"),
        "mismatch",
        kv_quant=True,
    ),
    Mutation(
        "prefill: padding rows left unwritten",
        "paged_prefill.metal",
        "o[i] = T(0.0f);",
        "(void)o;",
        ("prefill",),
        "nan",
    ),
]


def _case(
    path: str, windowed: bool = False, gqa: int = 2, kv_quant: bool = False
) -> tuple[Case, object]:
    """The batch for `path`: "prefill" runs the SIMT prefill kernel, "tiled" the
    simdgroup-matrix one, "mixed-split" a mixed batch whose decodes take split-K."""
    mixed = path in ("prefill", "tiled", "mixed-split")
    requests = mixed_requests(BS) if mixed else decode_requests(BS)
    variant: dict = {"window": 5, "sinks": True} if windowed else {}
    variant["kv_quant"] = kv_quant
    case = Case(requests, BS, gqa, head_dim=80, dtype="float32", pad_tokens=2, seed=3, **variant)
    config = {
        "split": split_config(BS),
        "mixed-split": split_config(BS),
        "prefill": MetalConfig(prefill="simt"),
    }.get(path)
    return case, config


def _factory(emu: Emulator, mutation: Mutation | None):
    if mutation is None:
        return emu.metal_kernel
    original = read_source(mutation.file)
    assert original.count(mutation.old) == 1, f"{mutation.name}: edit site not found once"
    mutated = original.replace(mutation.old, mutation.new)

    def factory(**kw):
        for key in ("source", "header"):
            if kw.get(key) == original:
                kw[key] = mutated
        return emu.metal_kernel(**kw)

    return factory


def _outcome(
    path: str,
    mutation: Mutation | None,
    windowed: bool = False,
    gqa: int = 2,
    kv_quant: bool = False,
) -> str:
    """How the checker judges the kernels: 'ok' or the kind of failure."""
    emu = Emulator(schedules=("forward", "reverse", "serial"), timeout_s=20.0)
    windowed = windowed or (mutation is not None and mutation.windowed)
    kv_quant = kv_quant or (mutation is not None and mutation.kv_quant)
    case, config = _case(path, windowed, mutation.gqa if mutation else gqa, kv_quant)
    factory = _factory(emu, mutation)  # outside the try: a missing edit site is no "mismatch"
    try:
        check(case, metal_backend(factory, config))
    except KernelError as e:
        msg = str(e)
        if "schedules" in msg:
            return "race"
        if "invalid memory access" in msg:
            return "fault"
        return "divergence"
    except CompileError:
        return "compile"
    except AssertionError as e:
        return "nan" if "nan" in str(e).lower() else "mismatch"
    return "ok"


@pytest.mark.parametrize("gqa", [2, 12])
@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "window+sinks"])
@pytest.mark.parametrize("path", ["decode", "split", "prefill", "tiled", "mixed-split"])
def test_unmutated_kernels_pass(path, windowed, gqa) -> None:
    assert _outcome(path, None, windowed, gqa) == "ok"


@pytest.mark.parametrize("path", ["decode", "split", "prefill", "tiled", "mixed-split"])
def test_unmutated_kernels_pass_on_8bit_pools(path) -> None:
    """The sites the kv_quant mutations edit run race-free and match on 8-bit pools."""
    assert _outcome(path, None, windowed=True, kv_quant=True) == "ok"


@pytest.mark.parametrize(
    "mutation,path",
    [(m, p) for m in MUTATIONS for p in m.paths],
    ids=[f"{m.name} [{p}]" for m in MUTATIONS for p in m.paths],
)
def test_mutation_is_caught(mutation: Mutation, path: str) -> None:
    assert _outcome(path, mutation) == mutation.caught_by


def test_every_kernel_has_mutations() -> None:
    files = {m.file for m in MUTATIONS}
    assert files == {
        "quantize_kv.metal",
        HEADER,
        "paged_decode.metal",
        "paged_decode_split.metal",
        "paged_decode_reduce.metal",
        "paged_prefill.metal",
    }
    assert np.unique([m.name for m in MUTATIONS]).size == len(MUTATIONS)
