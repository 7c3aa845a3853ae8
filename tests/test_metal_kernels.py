"""mlxserve's Metal kernels against the pure-MLX fallback, over every supported shape.

On Linux the kernels run on the CPU emulator of metal/checker; on a Mac the same tests also
run them for real on the GPU (the "metal" backend, skipped elsewhere).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import mlx.core as mx
import numpy as np
import pytest

from metal.checker import build
from metal.checker.cases import (
    Case,
    check,
    decode_requests,
    make_inputs,
    metal_backend,
    mixed_requests,
    run,
    split_config,
)
from metal.checker.emulator import Emulator
from metal.checker.record import Recorder
from mlxserve.ops.kv_quant import quantize as kv_quant_rows
from mlxserve.ops.metal import MetalConfig
from mlxserve.worker.pool_watch import buffer_address

DTYPES = ["float16", "bfloat16", "float32"]
HEAD_DIMS = [64, 80, 96, 128]
BLOCK_SIZES = [8, 16, 32]
GQA = [1, 3, 4, 8]
SWEEP = list(itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES, GQA))


def pairwise_cover(rows: list[tuple]) -> set[tuple]:
    """Rows of ``rows`` (greedily, in order) until every pair of values of any two columns
    that ``rows`` holds is in one of them: an interaction of two parameters is still run."""

    def pairs(row: tuple) -> set[tuple]:
        return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}

    todo, cover = set().union(*map(pairs, rows)), set()
    while todo:
        best = max(rows, key=lambda row: len(pairs(row) & todo))
        cover.add(best)
        todo -= pairs(best)
    return cover


# The emulator runs each kernel in Python (~0.3 s a case): it takes a pairwise cover of the
# sweep (every two parameters' values together at least once); real Metal runs all of it.
EMULATED = pairwise_cover(SWEEP)
# Sliding windows (within a block, across blocks, longer than every context) and attention
# sinks: (dtype, head_dim, block_size, gqa, window, sinks).
VARIANTS = [
    ("float32", 64, 8, 1, 1, False),
    ("float32", 64, 8, 4, 5, False),
    ("float16", 80, 8, 3, 11, True),
    ("bfloat16", 64, 16, 4, 3, True),
    ("float32", 128, 16, 8, 17, False),
    ("float32", 96, 8, 2, None, True),
    ("float16", 64, 32, 1, 1000, True),
]


def paths(
    dtype: str,
    head_dim: int,
    block_size: int,
    gqa: int,
    seed: int,
    window: int | None = None,
    sinks: bool = False,
    num_kv_heads: int = 2,
):
    """(name, case, config, kernels that must run) for the kernel paths: decode, split-K,
    and the varlen prefill (the simdgroup-matrix kernel, and the SIMT one it replaced)."""
    dec = decode_requests(block_size)
    variant = {"window": window, "sinks": sinks, "num_kv_heads": num_kv_heads}
    mixed = mixed_requests(block_size)
    return [
        (
            "decode",
            Case(dec, block_size, gqa, head_dim, dtype, pad_tokens=1, seed=seed, **variant),
            None,
            {"paged_decode"},
        ),
        (
            "split",
            Case(dec, block_size, gqa, head_dim, dtype, pad_tokens=1, seed=seed + 1, **variant),
            split_config(block_size),
            {"paged_decode_split", "paged_decode_reduce"},
        ),
        (
            "prefill",
            Case(mixed, block_size, gqa, head_dim, dtype, pad_tokens=2, seed=seed + 2, **variant),
            None,
            {"paged_prefill_tiled"},
        ),
        (
            "prefill-simt",
            Case(mixed, block_size, gqa, head_dim, dtype, pad_tokens=2, seed=seed + 3, **variant),
            SIMT,
            {"paged_prefill"},
        ),
    ]


SIMT = MetalConfig(prefill="simt")


# Shapes beyond the sweep: (id, case, config, kernels that must run on the emulator). A
# 10-core GPU is assumed for the split-K choice, so it is the same on every machine.
TEN_CORES = MetalConfig(gpu_cores=10)
LONG_DECODES = ((1, 1100), (1, 600), (1, 37))  # past split-K's 512 tokens, 6 groups < 40


def extended_cases() -> list[tuple[str, Case, MetalConfig | None, set[str]]]:
    """head_dim 256, GQA 16 (two head groups), multi-query (one KV head), >= 16 requests
    per launch, contexts past the split-K threshold (decode-only and mixed) and sliding
    windows there; each kernel path of the small shapes too."""
    out = []
    for dtype in DTYPES:  # head_dim 256: 8 simdgroups, 8 dims per lane
        for name, case, config, ran in paths(dtype, 256, 16, 4, seed=256):
            out.append((f"hd256-{dtype}-{name}", case, config, ran))
    for name, case, config, ran in paths("float16", 128, 16, 16, seed=16):
        out.append((f"gqa16-{name}", case, config, ran))
    for name, case, config, ran in paths("bfloat16", 64, 8, 12, 12, window=7, sinks=True):
        out.append((f"gqa12-window-sinks-{name}", case, config, ran))
    for gqa in (8, 16):  # multi-query: every query head shares one KV head
        for name, case, config, ran in paths("float32", 64, 16, gqa, seed=gqa, num_kv_heads=1):
            out.append((f"mqa{gqa}-{name}", case, config, ran))
    many = tuple((1, 3 + 7 * i) for i in range(20))
    out.append(
        (
            "20-decodes",
            Case(many, 16, 4, 64, "float16", pad_tokens=3),
            TEN_CORES,
            {"paged_decode"},
        )
    )
    mixed = many[:16] + ((17, 40), (5, 70), (16, 16))
    out.append(
        (
            "16-decodes-3-prefills",
            Case(mixed, 16, 4, 64, "bfloat16", pad_tokens=2),
            TEN_CORES,
            {"paged_prefill_tiled"},
        )
    )
    split = {"paged_decode_split", "paged_decode_reduce"}
    for name, window, ran in (
        ("long-decodes", None, split),
        ("long-decodes-window-600", 600, split),  # attends 600 >= 512: split, skips partitions
        ("long-decodes-window-300", 300, {"paged_decode"}),  # attends 300 only
    ):
        case = Case(LONG_DECODES, 16, 4, 128, "float16", pad_tokens=1, window=window, sinks=True)
        out.append((name, case, TEN_CORES, ran))
    long_mixed = (*LONG_DECODES, (20, 560))
    case = Case(long_mixed, 16, 16, 128, "bfloat16", pad_tokens=1, window=530)
    out.append(("long-decodes-in-mixed-step", case, TEN_CORES, split | {"paged_prefill_tiled"}))
    # head_dim not a multiple of 8: the SIMT prefill, chosen automatically.
    case = Case(mixed_requests(8), 8, 2, 36, "float32", pad_tokens=1, seed=36)
    out.append(("hd36-prefill-is-simt", case, None, {"paged_prefill"}))
    # The SIMT prefill stays selectable: every mixed shape above runs on it too.
    for name, case, config, ran in list(out):
        if "paged_prefill_tiled" in ran and not name.endswith("prefill"):
            simt = dataclasses.replace(config or MetalConfig(), prefill="simt")
            ran = ran - {"paged_prefill_tiled"} | {"paged_prefill"}
            out.append((f"{name}-simt", case, simt, ran))
    return out


EXTENDED = extended_cases()


@pytest.fixture(scope="session")
def emulator() -> Emulator:
    """The emulator, with every kernel variant of the sweep compiled up front in parallel."""
    if sys.platform != "linux":
        pytest.skip("the Metal emulator runs on Linux")
    rec = Recorder()
    sweeps = [(*p, 0) for p in SWEEP] + [(*v[:4], 0, *v[4:]) for v in VARIANTS]
    cases = [(case, config) for params in sweeps for _, case, config, _ in paths(*params)]
    cases += [(case, config) for _, case, config, _ in EXTENDED]
    for case, config in cases:
        run(make_inputs(case), case.dtype, metal_backend(rec.metal_kernel, config))
    build.compile_variants(rec.variants)
    return Emulator()


@pytest.fixture(params=["emulator", "metal"])
def kernels(request):
    """(factory, emulator or None): where the Metal kernels run."""
    if request.param == "metal":
        if not mx.metal.is_available():
            pytest.skip("real Metal path: needs a Mac with Metal")
        return None, None
    emu = request.getfixturevalue("emulator")
    return emu.metal_kernel, emu


@pytest.mark.parametrize("dtype,head_dim,block_size,gqa", SWEEP)
def test_kernels_match_fallback(kernels, dtype, head_dim, block_size, gqa) -> None:
    factory, emu = kernels
    if emu and (dtype, head_dim, block_size, gqa) not in EMULATED:
        pytest.skip("the emulator runs a pairwise cover of the sweep (real Metal: all of it)")
    seed = head_dim * 100 + block_size * 10 + gqa
    for name, case, config, expected in paths(dtype, head_dim, block_size, gqa, seed):
        if name == "prefill-simt" and block_size != 16:  # the SIMT prefill: a third of the sweep
            continue
        before = len(emu.launches) if emu else 0
        check(case, metal_backend(factory, config))
        if emu:
            ran = {launch["name"] for launch in emu.launches[before:]}
            assert ran == expected, (name, ran)


@pytest.mark.parametrize("dtype,head_dim,block_size,gqa,window,sinks", VARIANTS)
def test_window_and_sinks_match_fallback(
    kernels, dtype, head_dim, block_size, gqa, window, sinks
) -> None:
    factory, _ = kernels
    seed = head_dim * 100 + block_size * 10 + gqa + 7
    for _, case, config, _ in paths(dtype, head_dim, block_size, gqa, seed, window, sinks):
        check(case, metal_backend(factory, config))


# 8-bit pools (--kv-cache-dtype int8): (dtype of q and the new rows, head_dim, block_size,
# gqa, window, sinks). Both sides read the same quantized pool, so the dtype's tolerance
# holds; the written pools must be byte-equal (the same rounding as ops/kv_quant.quantize).
KV_QUANT = [
    ("float32", 64, 8, 4, None, False),
    ("float16", 128, 16, 1, None, False),
    ("bfloat16", 96, 16, 3, 5, True),
    ("float32", 36, 8, 9, None, True),
]


@pytest.mark.parametrize("dtype,head_dim,block_size,gqa,window,sinks", KV_QUANT)
def test_8bit_pools_match_fallback(kernels, dtype, head_dim, block_size, gqa, window, sinks):
    factory, emu = kernels
    seed = head_dim * 100 + block_size * 10 + gqa + 11
    for name, case, config, expected in paths(dtype, head_dim, block_size, gqa, seed, window):
        case = dataclasses.replace(case, kv_quant=True, sinks=sinks)
        if name == "prefill" and head_dim % 8:
            expected = {"paged_prefill"}  # the tiled kernel needs head_dim % 8 == 0
        before = len(emu.launches) if emu else 0
        check(case, metal_backend(factory, config))
        if emu:
            ran = {launch["name"] for launch in emu.launches[before:]}
            assert ran == expected | {"quantize_kv"}, (name, ran)


@pytest.mark.parametrize("name,case,config,expected", EXTENDED, ids=[c[0] for c in EXTENDED])
def test_extended_shapes_match_fallback(kernels, name, case, config, expected) -> None:
    factory, emu = kernels
    before = len(emu.launches) if emu else 0
    check(case, metal_backend(factory, config))
    if emu:
        ran = {launch["name"] for launch in emu.launches[before:]}
        assert ran == expected, (name, ran)


@pytest.mark.parametrize("kv_quant", [False, True], ids=["float16", "int8"])
def test_the_pool_write_is_in_place_on_the_metal_path(kernels, kv_quant) -> None:
    """The Metal path writes the pool with MLX's scatter into the old pool's own buffer
    (donated): exactly the new tokens' slots change, to the fallback's bytes. (The write
    is evaluated on its own: the emulator runs kernels eagerly, while the caller still
    holds the old pools, which a real lazy graph would not.)"""
    factory, emu = kernels
    case = Case(mixed_requests(8), 8, 2, 64, "float16", pad_tokens=0, seed=7)
    inp = make_inputs(case)
    k_cache = mx.array(inp.k_pool).astype(mx.float16)
    v_cache = mx.array(inp.v_pool).astype(mx.float16)
    if kv_quant:
        k_cache, v_cache = kv_quant_rows(k_cache), kv_quant_rows(v_cache)
    mx.eval(k_cache, v_cache)
    k_before, v_before = np.array(k_cache), np.array(v_cache)
    addresses = [buffer_address(k_cache), buffer_address(v_cache)]
    keys = mx.array(inp.keys).astype(mx.float16)
    values = mx.array(inp.values).astype(mx.float16)
    from mlxserve import ops

    before = len(emu.launches) if emu else 0
    with ops.force_backend("metal", factory, self_test="raise"):
        k_cache, v_cache = ops.write_kv(k_cache, v_cache, keys, values, inp.md.slot_mapping)
        mx.eval(k_cache, v_cache)
    if emu:  # the self-test's launch, then the step's
        assert [x["name"] for x in emu.launches[before:]] == ["quantize_kv"] * 2 * kv_quant
    assert [buffer_address(k_cache), buffer_address(v_cache)] == addresses  # no copy made
    slots = np.array(inp.md.slot_mapping)
    for got, old, new in ((k_cache, k_before, keys), (v_cache, v_before, values)):
        rows = old.reshape(-1, *old.shape[2:]).copy()
        rows[slots] = np.array(kv_quant_rows(new) if kv_quant else new)  # the fallback's bytes
        np.testing.assert_array_equal(np.array(got).reshape(rows.shape), rows)


def test_attention_reads_the_pools_the_write_returned() -> None:
    """Each attention kernel takes as its pools the scatter's outputs, so MLX orders it after
    the write (and after anything else that wrote them), on the GPU as in the graph."""
    from mlxserve import ops

    seen: dict[str, list] = {}

    def spy(**kwargs):
        name = kwargs["name"]

        def call(**call_kwargs):
            seen[name] = call_kwargs["inputs"]
            return [
                mx.zeros(s, d)
                for s, d in zip(
                    call_kwargs["output_shapes"], call_kwargs["output_dtypes"], strict=True
                )
            ]

        return call

    for requests in (decode_requests(8), mixed_requests(8)):
        inp = make_inputs(Case(requests, 8, 2, 64))
        k_cache, v_cache = mx.array(inp.k_pool), mx.array(inp.v_pool)
        with ops.force_backend("metal", spy):
            k_new, v_new = ops.write_kv(
                k_cache, v_cache, mx.array(inp.keys), mx.array(inp.values), inp.md.slot_mapping
            )
            ops.paged_attention(mx.array(inp.q), k_new, v_new, inp.md, inp.scale)
        reader = "paged_prefill_tiled" if requests == mixed_requests(8) else "paged_decode"
        assert seen[reader][1] is k_new and seen[reader][2] is v_new
        assert k_new.shape == k_cache.shape and k_new is not k_cache
