"""Mutation tests of the simdgroup-matrix prefill kernel and of the shim's simdgroup matrices.

Known bugs injected into paged_prefill_tiled.metal (removed barriers, wrong tile offsets, a
wrong block-table index, a missing rescale, ...) and into the shim's 8x8 matrix operations
must each be caught the way the test names: see tests/test_metal_mutations.py.
"""

from __future__ import annotations

import sys

import pytest

from metal.checker import build
from tests.test_metal_mutations import LANE_EXIT, Mutation, _outcome

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulator runs on Linux")

TILED = "paged_prefill_tiled.metal"


def _tiled(name: str, old: str, new: str, caught_by: str, gqa: int = 2) -> Mutation:
    return Mutation(f"tiled: {name}", TILED, old, new, ("tiled",), caught_by, gqa=gqa)


MUTATIONS = [
    Mutation(
        "tiled: V dequantized with the K row's scale",
        TILED,
        "kv_row_scale<KV_QUANT, HEAD_DIM>(v_cache + at)",
        "kv_row_scale<KV_QUANT, HEAD_DIM>(k_cache + at)",
        ("tiled",),
        "mismatch",
        kv_quant=True,
    ),
    _tiled(
        "barrier removed between the block-table read and the staging",
        "        : int64_t(-1);\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);",
        "        : int64_t(-1);\n  }\n",
        "race",
    ),
    _tiled(
        "barrier removed after staging K",
        "0.0f;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  // S = Q K^T",
        "0.0f;\n  }\n\n  // S = Q K^T",
        "race",
    ),
    _tiled(
        "barrier removed before V overwrites K",
        "threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with K^T",
        "//",
        "race",
    ),
    _tiled(
        "barrier removed after staging V",
        "0.0f;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  // O += P V.",
        "0.0f;\n  }\n\n  // O += P V.",
        "race",
    ),
    _tiled(
        "simdgroup barrier removed before the softmax reads S",
        "  }\n  simdgroup_barrier(mem_flags::mem_threadgroup);\n\n  // Online softmax",
        "  }\n\n  // Online softmax",
        "race",
    ),
    _tiled(
        "simdgroup barrier removed before P and the correction are loaded",
        "  simdgroup_barrier(mem_flags::mem_threadgroup);\n  simdgroup_float8x8 rescale;",
        "  simdgroup_float8x8 rescale;",
        "race",
    ),
    _tiled(
        "K^T tile offset ignores the key column",
        "simdgroup_load(kt, kv + c * 8 * BK + n * 8, BK);",
        "simdgroup_load(kt, kv + c * 8 * BK, BK);",
        "mismatch",
    ),
    _tiled(
        "P tile offset ignores the key column",
        "simdgroup_load(p, my_scores + n * 8, BK);",
        "simdgroup_load(p, my_scores, BK);",
        "mismatch",
    ),
    _tiled(
        "V tile offset ignores the key row",
        "simdgroup_load(v, kv + n * 8 * HEAD_DIM + c * 8, HEAD_DIM);",
        "simdgroup_load(v, kv + c * 8, HEAD_DIM);",
        "mismatch",
    ),
    _tiled(
        "output column offset dropped",
        "HEAD_DIM + c * 8 + idx % 8] =",
        "HEAD_DIM + idx % 8] =",
        "nan",
    ),
    _tiled(
        "wrong block-table index",
        "table[t / BLOCK_SIZE]",
        "table[(t + 1) / BLOCK_SIZE]",
        "mismatch",
    ),
    _tiled(
        "O not rescaled when a row's max grows",
        "    simdgroup_multiply(of[c], rescale, of[c]);\n",
        "",
        "mismatch",
    ),
    _tiled(
        "causal mask off by one", "first_pos + my_j + 1 : 0", "first_pos + my_j + 2 : 0", "mismatch"
    ),
    _tiled(
        "every head group takes the first group's heads",
        "% HG) * GH;",
        "% HG) * 0;",
        "nan",
        gqa=40,
    ),
    _tiled("early lane exit", "// Normalize and write", LANE_EXIT + "// Normalize", "divergence"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_tiled_mutation_is_caught(mutation: Mutation) -> None:
    assert _outcome("tiled", mutation) == mutation.caught_by


def test_tiled_kernel_with_head_groups_passes() -> None:
    assert _outcome("tiled", None, gqa=40) == "ok"


SHIM_MUTATIONS = [
    (
        "multiply-accumulate drops the accumulator",
        "out[j] = full ? acc + mine.c[j] : poison<float>();",
        "out[j] = full ? acc : poison<float>();",
    ),
    (
        "load ignores the row stride",
        "const float x0 = float(src[r * elements_per_row + c]);",
        "const float x0 = float(src[r * 8 + c]);",
    ),
    (
        "lane layout inverse swaps column pairs",
        "((col & 4) << 1) | ((col >> 1) & 1));",
        "((col & 4) << 1) | ((col >> 2) & 1));",
    ),
    (
        "multiply-accumulate transposes b",
        "l.v[frag_lane(k, c0 + j)].b[(c0 + j) & 1];",
        "l.v[frag_lane(c0 + j, k)].b[k & 1];",
    ),
]


@pytest.mark.parametrize(
    "old,new", [m[1:] for m in SHIM_MUTATIONS], ids=[m[0] for m in SHIM_MUTATIONS]
)
def test_a_wrong_shim_matrix_op_is_caught(old, new, tmp_path, monkeypatch) -> None:
    """The kernel tests rest on the shim's matrix operations: a wrong one fails them."""
    text = build.SHIM.read_text()
    assert text.count(old) == 1
    shim = tmp_path / "metal_stdlib.h"
    shim.write_text(text.replace(old, new))
    monkeypatch.setattr(build, "SHIM", shim)
    assert _outcome("tiled", None) == "mismatch"
