"""The Linux checker itself: MLX-faithful signatures, static compiles, emulator semantics."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metal.checker import build, toolchain
from metal.checker.cases import (
    Case,
    decode_requests,
    make_inputs,
    metal_backend,
    mixed_requests,
)
from metal.checker.cases import run as run_case
from metal.checker.emulator import Emulator, KernelError
from metal.checker.record import Recorder
from mlxserve.ops.metal import MetalConfig, read_source

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the checker runs on Linux")


# ---- the generated source is MLX's ------------------------------------------------------
def _mlx_sources(fn, args, capfd, path) -> set[str]:
    """Kernel sources MLX generates while exporting fn (verbose=True prints them; exporting
    records kernels without compiling them, so this works without Metal)."""
    capfd.readouterr()
    mx.export_function(str(path), fn, *args)
    out = capfd.readouterr().out
    return set(re.findall(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", out, re.S))


# Split every decode, also in mixed batches (as a GPU of 10 cores would these small batches).
SPLIT = MetalConfig(partition_size=29, split_min_context=1, gpu_cores=10)
SIMT = MetalConfig(prefill="simt")  # the SIMT prefill kernel, still selectable


def _verbose_factory(**kwargs):
    kernel = mx.fast.metal_kernel(**kwargs)
    return lambda **call: kernel(**call, verbose=True)


@pytest.mark.parametrize("requests", [decode_requests(16), mixed_requests(16)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_signatures_match_mlx(requests, dtype, capfd, tmp_path) -> None:
    """Our mirror of MLX's signature generator produces MLX's exact text for our kernels."""
    case = Case(requests, 16, 4, 80, dtype, pad_tokens=1)
    inp = make_inputs(case)
    rec = Recorder()
    configs = [None, SPLIT, SIMT]
    for config in configs:
        run_case(inp, dtype, metal_backend(rec.metal_kernel, config))
    from metal.checker.cases import DTYPES
    from mlxserve import ops

    dt = DTYPES[dtype]

    def forward(q, keys, values, k_cache, v_cache):
        k_cache, v_cache = ops.write_kv(k_cache, v_cache, keys, values, inp.md.slot_mapping)
        return ops.paged_attention(q, k_cache, v_cache, inp.md, inp.scale), k_cache, v_cache

    args = [mx.array(a).astype(dt) for a in (inp.q, inp.keys, inp.values, inp.k_pool, inp.v_pool)]
    ours = {g.source for g in rec.variants}
    theirs: set[str] = set()
    for i, config in enumerate(configs):
        with ops.force_backend("metal", _verbose_factory, config):
            theirs |= _mlx_sources(forward, args, capfd, tmp_path / f"f{i}.mlxfn")
    assert theirs == ours
    # decode or both prefill kernels, split-K's two
    assert len(ours) == (3 if requests == decode_requests(16) else 4)


def test_signature_edge_cases_match_mlx(capfd, tmp_path) -> None:
    """Shape/strides/ndim buffers, 0-d and small (constant) inputs, template kinds,
    several outputs without thread attributes."""
    kernels = [
        mx.fast.metal_kernel(
            name="edge_a",
            input_names=["a", "s", "small"],
            output_names=["o"],
            source="o[0] = a[a_ndim - 1] + a_strides[0] + s + small[0]; // grid_size",
            header="// a header line\n",
        ),
        mx.fast.metal_kernel(
            name="edge_b",
            input_names=["x"],
            output_names=["o1", "o2"],
            source="o1[0] = x[x_shape[0] - 1]; o2[0] = 0;",
        ),
    ]
    templates = [[("T", mx.bfloat16), ("N", 3), ("B", True)], None]
    inputs = [
        lambda a: [a, mx.array(2.0), mx.array([1, 2, 3], dtype=mx.int32)],
        lambda a: [a],
    ]
    rec = Recorder()
    rec_kernels = [
        rec.metal_kernel(
            "edge_a",
            ["a", "s", "small"],
            ["o"],
            "o[0] = a[a_ndim - 1] + a_strides[0] + s + small[0]; // grid_size",
            "// a header line\n",
        ),
        rec.metal_kernel("edge_b", ["x"], ["o1", "o2"], "o1[0] = x[x_shape[0] - 1]; o2[0] = 0;"),
    ]
    nout = [1, 2]
    for k, rk, tmpl, ins, n in zip(kernels, rec_kernels, templates, inputs, nout, strict=True):

        def fn(a, k=k, tmpl=tmpl, ins=ins, n=n):
            return k(
                inputs=ins(a),
                output_shapes=[(1,)] * n,
                output_dtypes=[mx.float16] * n,
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
                template=tmpl,
                verbose=True,
            )

        theirs = _mlx_sources(fn, [mx.ones((16,))], capfd, tmp_path / f"e{n}.mlxfn")
        rk(
            inputs=ins(mx.ones((16,))),
            output_shapes=[(1,)] * n,
            output_dtypes=[mx.float16] * n,
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            template=tmpl,
        )
        ours = {
            g.source
            for g in rec.variants
            if g.kernel_name.startswith("custom_kernel_" + ("edge_a" if n == 1 else "edge_b"))
        }
        assert theirs == ours, (theirs, ours)


# ---- static checks -----------------------------------------------------------------------
def _recorded_variants() -> list:
    rec = Recorder()
    for dtype in ("float16", "bfloat16", "float32"):
        for head_dim in (64, 80, 96, 128):
            for gqa, requests in (
                (1, decode_requests(16)),
                (4, mixed_requests(16)),
                (8, decode_requests(16)[:2] * 5),
            ):
                cases = [Case(requests, 16, gqa, head_dim, dtype)]
                if head_dim == 64:  # sliding window and sinks (constant / device bound)
                    cases.append(Case(requests, 16, gqa, head_dim, dtype, window=5, sinks=True))
                if head_dim == 128:  # 8-bit pools (--kv-cache-dtype int8)
                    cases.append(Case(requests, 16, gqa, head_dim, dtype, kv_quant=True))
                for case in cases:
                    inp = make_inputs(case)
                    for config in (None, SPLIT, SIMT):
                        run_case(inp, dtype, metal_backend(rec.metal_kernel, config))
    return rec.variants


def require_clang() -> None:
    """Skip a clang check, saying why, when no fit clang exists; CI (MLXSERVE_REQUIRE_CLANG=1,
    set by .ci/run) and an explicit MLXSERVE_CLANG make that a failure instead."""
    tc = build.find_toolchain()
    if tc.clang is None:
        if os.environ.get("MLXSERVE_REQUIRE_CLANG") or os.environ.get("MLXSERVE_CLANG"):
            pytest.fail(tc.clang_missing_reason)
        pytest.skip(tc.clang_missing_reason)


def test_clang_is_available() -> None:
    """CI must have the address-space checker: there, a missing clang fails this test."""
    require_clang()
    assert build.find_toolchain().clang is not None


def fake_clang(path: Path, name: str, accepts: bool) -> None:
    """An executable `name` in `path` that passes or fails any compile like an unfit clang."""
    script = (
        "exit 0" if accepts else "echo 'x.h:72:9: error: _Float16 is not supported' >&2; exit 1"
    )
    exe = path / name
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(0o755)


def test_clang_search_probes_the_shim_and_says_what_it_tried(tmp_path, monkeypatch) -> None:
    """Each clang found is tried on the shim: an unfit one (Debian 12's clang-14 rejects
    _Float16) is passed over for a fit one; with none fit, the reason lists what failed."""
    monkeypatch.delenv("MLXSERVE_CLANG", raising=False)
    monkeypatch.setenv("MLXSERVE_CXX", shutil.which("g++") or "g++")
    monkeypatch.setattr(toolchain.importlib.util, "find_spec", lambda name: None)  # no ziglang
    both, unfit_only = tmp_path / "both", tmp_path / "unfit"
    for d in (both, unfit_only):
        d.mkdir()
        fake_clang(d, "clang", accepts=False)
    fake_clang(both, "clang-18", accepts=True)
    monkeypatch.setenv("PATH", str(both))
    assert build.find_toolchain().clang == [str(both / "clang-18")]
    monkeypatch.setenv("PATH", str(unfit_only))
    tc = build.find_toolchain()
    assert tc.clang is None
    assert tc.clang_missing_reason == (
        f"no clang fit for the address-space check ({unfit_only}/clang: _Float16 is not "
        f"supported); {toolchain.INSTALL_HINT}"
    )
    monkeypatch.setenv("MLXSERVE_CLANG", str(unfit_only / "clang"))
    assert build.find_toolchain().clang_missing_reason == (
        f"MLXSERVE_CLANG='{unfit_only}/clang' cannot check the shim: _Float16 is not supported"
    )


def test_every_kernel_compiles_with_gxx_and_clang_address_spaces() -> None:
    variants = _recorded_variants()
    names = {g.kernel_name.split("__")[0] for g in variants}
    assert names == {
        "custom_kernel_quantize_kv",
        "custom_kernel_paged_decode",
        "custom_kernel_paged_decode_split",
        "custom_kernel_paged_decode_reduce",
        "custom_kernel_paged_prefill",
        "custom_kernel_paged_prefill_tiled",
    }
    # inputs with fewer than 8 elements are bound as `constant`: the 1-element sinks dummy
    # is, real sinks are `device`; metadata is padded, so always `device`
    sigs = "".join(g.signature for g in variants)
    assert "const constant float* sinks" in sigs and "const device float* sinks" in sigs
    for meta in ("context_lens", "query_start_loc", "block_tables"):
        assert f"const device int32_t* {meta}" in sigs
        assert f"const constant int32_t* {meta}" not in sigs
    build.static_check(variants, modes=("emulate",))
    require_clang()
    build.static_check(variants, modes=("as_check",))


def _mutated_variant(file: str, old: str, new: str):
    rec = Recorder()
    text = read_source(file)
    assert text.count(old) == 1
    kernel = rec.metal_kernel(
        "quantize_kv", ["keys", "values"], ["k_rows", "v_rows"], text.replace(old, new)
    )
    kv = mx.zeros((4, 2, 8))
    kernel(
        inputs=[kv, kv],
        output_shapes=[(4, 2, 12), (4, 2, 12)],
        output_dtypes=[mx.int8, mx.int8],
        grid=(64, 4, 1),
        threadgroup=(32, 1, 1),
        template=[("T", mx.float32), ("HEAD_DIM", 8)],
    )
    return rec.variants


QUANTIZE_K = "quantize_row<HEAD_DIM>(keys + row * HEAD_DIM, k_rows + "


def test_clang_rejects_an_address_space_error() -> None:
    """Dropping `device` from a pointer into an output is an error for Apple's compiler;
    g++ alone would accept it, the clang address-space mode does not."""
    require_clang()
    variants = _mutated_variant(
        "quantize_kv.metal",
        QUANTIZE_K,
        "int8_t* k_out = k_rows; quantize_row<HEAD_DIM>(keys + row * HEAD_DIM, k_out + ",
    )
    with pytest.raises(
        build.CompileError,
        match=r"metal/quantize_kv\.metal \(edited copy\):\d+:\d+: error: ",
    ):
        build.static_check(variants)


@pytest.mark.parametrize(
    "old,new,message",
    [
        (
            "const int num_kv_heads = keys_shape[1];",
            "const int num_kv_heads = keys_shape[1]",
            r"metal/quantize_kv\.metal \(edited copy\):\d+:\d+: error: expected",
        ),
        (
            "const int num_kv_heads = keys_shape[1];",
            "const double num_kv_heads = keys_shape[1];",
            "mlxs_metal_has_no_double_type",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["emulate", "as_check"])
def test_static_check_reports_the_kernel_line(old, new, message, mode) -> None:
    if mode == "as_check":
        require_clang()
    with pytest.raises(build.CompileError, match=message):
        build.static_check(_mutated_variant("quantize_kv.metal", old, new), modes=(mode,))


# ---- emulator semantics ------------------------------------------------------------------
REDUCE = """
  uint lane = thread_index_in_simdgroup;
  uint sg = simdgroup_index_in_threadgroup;
  threadgroup float part[4];
  float v = x[thread_position_in_grid.x];
  float s = simd_sum(v);
  float m = simd_max(v);
  float n = simd_shuffle_xor(v, 1);
  y[thread_position_in_grid.x] = n;
  if (lane == 0) { part[sg] = s; }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_index_in_threadgroup == 0) {
    float t = 0.0f;
    for (uint i = 0; i < simdgroups_per_threadgroup; ++i) { t += part[i]; }
    out[threadgroup_position_in_grid.x] = t;
    mx_out[threadgroup_position_in_grid.x] = m;
  }
"""


def _reduce(emu, source=REDUCE, n=256, tg=128, **kw):
    k = emu.metal_kernel("reduce", ["x"], ["out", "mx_out", "y"], source)
    x = mx.array(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    outs = k(
        inputs=[x],
        output_shapes=[(n // tg,), (n // tg,), (n,)],
        output_dtypes=[mx.float32] * 3,
        grid=(n, 1, 1),
        threadgroup=(tg, 1, 1),
        **kw,
    )
    return np.array(x), [np.array(o) for o in outs]


def test_emulator_collectives_and_threadgroup_memory() -> None:
    x, (total, last_max, shuffled) = _reduce(Emulator(schedules=("forward", "reverse")))
    np.testing.assert_allclose(total, x.reshape(2, 128).sum(1), rtol=1e-5)
    np.testing.assert_array_equal(last_max, x.reshape(2, 4, 32)[:, 0].max(1))  # thread 0's
    np.testing.assert_array_equal(shuffled, x.reshape(-1, 2)[:, ::-1].reshape(-1))


def test_emulator_poisons_unwritten_outputs_and_honours_init_value() -> None:
    half = "if (thread_position_in_grid.x % 2 == 0) { out[thread_position_in_grid.x] = 1.0f; }"
    k = Emulator().metal_kernel("half", ["x"], ["out"], half)
    args = dict(
        inputs=[mx.zeros((8,))],
        output_shapes=[(8,)],
        output_dtypes=[mx.float32],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
    )
    out = np.array(k(**args)[0])
    assert np.all(out[::2] == 1) and np.all(np.isnan(out[1::2]))
    out = np.array(k(**args, init_value=3.0)[0])
    assert out.tolist() == [1, 3] * 4


def test_emulator_refuses_a_kernel_that_writes_an_input() -> None:
    """Inputs are read-only in MLX's contract (it tracks only outputs): a kernel writing
    through an input pointer is reported, and the array is left as it was."""
    src = "const_cast<device float*>(x)[thread_position_in_grid.x] += 1.0f; out[0] = 0;"
    k = Emulator().metal_kernel("writes_input", ["x"], ["out"], src)
    x = mx.arange(8, dtype=mx.float32)
    mx.eval(x)
    args = {"output_shapes": [(1,)], "output_dtypes": [mx.int32], "grid": (8, 1, 1)}
    with pytest.raises(KernelError, match=r"writes its input `x`; inputs are read-only"):
        k(inputs=[x], threadgroup=(8, 1, 1), **args)
    assert np.array(x).tolist() == list(range(8))


def test_emulator_thread_ids_on_partial_threadgroups() -> None:
    src = """
      uint i = thread_position_in_grid.x;
      out[3 * i] = float(threads_per_threadgroup.x);
      out[3 * i + 1] = float(thread_index_in_simdgroup);
      out[3 * i + 2] = float(simdgroup_index_in_threadgroup);
    """
    k = Emulator().metal_kernel("ids", ["x"], ["out"], src)
    out = np.array(
        k(
            inputs=[mx.zeros((8,))],
            output_shapes=[(150,)],
            output_dtypes=[mx.float32],
            grid=(50, 1, 1),
            threadgroup=(40, 1, 1),
        )[0]
    )
    out = out.reshape(50, 3)
    assert out[:40, 0].tolist() == [40] * 40 and out[40:, 0].tolist() == [10] * 10
    assert out[:40, 1].tolist() == [i % 32 for i in range(40)]
    assert out[:40, 2].tolist() == [i // 32 for i in range(40)]


@pytest.mark.parametrize(
    "old,new,pattern",
    [
        (
            "threadgroup_barrier(mem_flags::mem_threadgroup);",
            "",
            "differs between the forward and reverse",
        ),
        (
            "uint lane =",
            "if (thread_index_in_threadgroup > 100) { return; }\n  uint lane =",
            r"(?s)barrier divergence.*threads 101-127: exited",
        ),
        (
            "float m = simd_max(v);",
            "float m = lane < 16 ? simd_max(v) : simd_min(v);",
            r"(?s)divergence in simdgroup 0.*simd_max \(custom_kernel_reduce\w*:body:7",
        ),
        (
            "part[sg] = s;",
            "part[sg + 1] = s;",
            r"past the end of threadgroup array `part` "
            r"\(declared at custom_kernel_reduce\w*:body:4\)",
        ),
        (
            "float v = x[thread_position_in_grid.x];",
            "float v = x[thread_position_in_grid.x + 1];",
            "past the end of `x`",
        ),
        (
            "float s = simd_sum(v);",
            "while (x[0] < 1e30f) {}\n  float s = simd_sum(v);",
            "did not finish within its CPU-time limit",
        ),
        (
            "threadgroup float part[4];",
            "threadgroup float part[4];\n  threadgroup float big[9000];",
            "exceeds the 32768 bytes",
        ),
    ],
)
def test_emulator_reports_kernel_bugs(old, new, pattern) -> None:
    emu = Emulator(schedules=("forward", "reverse"), timeout_s=1.0)
    assert REDUCE.count(old) == 1
    with pytest.raises(KernelError, match=pattern):
        _reduce(emu, REDUCE.replace(old, new))


def test_errors_name_the_kernel_file_and_line() -> None:
    """A bug in mlxserve's kernels is reported at metal/<file>.metal:<line>."""
    header = read_source("attention_common.metal")
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n\n// Merges row r"
    line = header[: header.index(barrier)].count("\n") + 1
    decode = read_source("paged_decode.metal")
    old = "publish_stats<ROWS, NUM_SIMD>(m, l, tg_stats, simd, lane);"
    exit_line = decode[: decode.index(old)].count("\n") + 1

    def factory(**kw):
        if kw["name"] == "paged_decode":
            kw["source"] = kw["source"].replace(old, "if (lane == 31) { return; }\n" + old)
        return Emulator().metal_kernel(**kw)

    inp = make_inputs(Case(decode_requests(8), 8, 2, 64))
    with pytest.raises(KernelError) as err:
        run_case(inp, "float32", metal_backend(factory))
    msg = str(err.value)
    assert f"at threadgroup_barrier (metal/attention_common.metal:{line}, call #1)" in msg
    assert "threads 31,63,95,127: exited" in msg
    assert exit_line > 1 and build._origin(decode) == "metal/paged_decode.metal"
