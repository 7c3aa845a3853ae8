"""Kernel self-test and fallback (ops/selftest.py), with failing kernels injected through the
emulator's factory: a compile error, a wrong result, a wrong 8-bit row quantization."""

from __future__ import annotations

import logging
import sys
from contextlib import nullcontext
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from metal.checker.cases import (
    TOLERANCE,
    Case,
    fallback_backend,
    make_inputs,
    mixed_requests,
    split_config,
)
from metal.checker.cases import run as run_case
from mlxserve import ops
from mlxserve.ops.metal import MetalConfig, MetalKernels
from mlxserve.ops.selftest import KernelSelfTestError

DECODE = Case(requests=((1, 5), (1, 11)), block_size=4, gqa=2, head_dim=32, seed=1)
MIXED = Case(requests=mixed_requests(4), block_size=4, gqa=2, head_dim=32, seed=2)
DECODE_Q8 = replace(DECODE, kv_quant=True)  # 8-bit pools: quantize_kv runs too


def broken(emu, kernel: str, how: str):
    """An mx.fast.metal_kernel stand-in: the emulator, with `kernel` broken `how`."""

    def factory(**kw):
        if kw["name"] == kernel and how == "compile":
            kw["source"] += "\nthis is not Metal;\n"
        if kw["name"] == kernel and how == "wrong":  # a softmax temperature bug
            assert "* scale" in kw["source"]
            kw["source"] = kw["source"].replace("* scale", "* (2.0f * scale)")
        if kw["name"] == kernel and how == "swap":  # V rows quantized from K
            old = "quantize_row<HEAD_DIM>(values"
            assert old in kw["source"]
            kw["source"] = kw["source"].replace(old, "quantize_row<HEAD_DIM>(keys")
        return emu.metal_kernel(**kw)

    return factory


@pytest.fixture
def emu():
    if sys.platform != "linux":
        pytest.skip("the Metal emulator runs on Linux")
    from metal.checker.emulator import Emulator

    return Emulator()


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="mlxserve")
    return lambda: [r.getMessage() for r in caplog.records if "self-test" in r.getMessage()]


def _check_twice(case: Case, factory, config: MetalConfig | None = None):
    """Run `case` twice on one kernels object built from `factory` (self-test mode
    "fallback"); each result must equal the fallback's. Returns the kernels object."""
    inp = make_inputs(case)
    want = run_case(inp, case.dtype, fallback_backend)
    tol = TOLERANCE[case.dtype]
    with ops.force_backend("metal", factory, config, self_test="fallback") as kernels:
        for _ in range(2):
            got = run_case(inp, case.dtype, nullcontext)
            np.testing.assert_allclose(got[0], want[0], atol=tol, rtol=tol, err_msg="attention")
            np.testing.assert_array_equal(got[1], want[1], err_msg="k_cache")
            np.testing.assert_array_equal(got[2], want[2], err_msg="v_cache")
    return kernels


@pytest.mark.parametrize(
    "case,kernel,how,detail",
    [
        (DECODE, "paged_decode", "compile", "compile or launch error"),
        (MIXED, "paged_prefill_tiled", "wrong", "mismatch: max abs error"),
        (DECODE_Q8, "quantize_kv", "swap", "mismatch: v_rows scales differ"),
    ],
)
def test_a_failing_kernel_falls_back_with_one_warning(
    emu, warnings, case, kernel, how, detail
) -> None:
    """Each broken kernel: every output equals the fallback's, two batches give one
    self-test and one warning naming the kernel, its variant and the MLX version."""
    kernels = _check_twice(case, broken(emu, kernel, how))
    (message,) = warnings()
    assert f"Metal kernel {kernel}<T=float32" in message
    assert detail in message
    assert f"MLX {mx.__version__}" in message
    failed = [r.variant.split("<")[0] for r in kernels.self_tests.values() if not r.ok]
    assert failed == [kernel]
    names = [launch["name"] for launch in emu.launches]
    if how != "compile":  # launched by its self-test only, never for the batches
        assert names.count(kernel) == 1
    if how == "swap":  # the rows are quantized by MLX ops, the attention kernel still runs
        assert names.count("paged_decode") == 3


@pytest.mark.parametrize("kv_quant", [False, True], ids=["float32", "int8"])
def test_healthy_kernels_pass_and_run(emu, warnings, kv_quant) -> None:
    kernels = _check_twice(replace(MIXED, kv_quant=kv_quant), emu.metal_kernel)
    assert warnings() == []
    results = kernels.self_tests.values()
    want = {"paged_prefill_tiled", "quantize_kv"} if kv_quant else {"paged_prefill_tiled"}
    assert {r.variant.split("<")[0] for r in results} == want
    assert all(r.ok for r in results)
    names = [launch["name"] for launch in emu.launches]  # one self-test, then two batches
    assert [names.count(name) for name in want] == [3] * len(want)


def test_split_decode_variant_is_self_tested(emu, warnings) -> None:
    _check_twice(DECODE, broken(emu, "paged_decode_reduce", "compile"), split_config(4))
    (message,) = warnings()
    assert "paged_decode_split+paged_decode_reduce<T=float32" in message
    assert "PARTITION_SIZE=5" in message


@pytest.mark.skipif(not mx.metal.is_available(), reason="real Metal path: needs a Mac with Metal")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_real_metal_kernels_pass_their_self_tests(dtype) -> None:
    """On a Mac (CI): every variant these batches use passes, in raise mode."""
    for case in (DECODE, MIXED, DECODE_Q8):
        case = replace(case, dtype=dtype)
        inp = make_inputs(case)
        with ops.force_backend("metal", None, MetalConfig(), self_test="raise") as kernels:
            run_case(inp, dtype, nullcontext)
        assert kernels.self_tests and all(r.ok for r in kernels.self_tests.values())


def test_raise_mode_fails_loudly(emu) -> None:
    """kernels='metal' (CI): a failed self-test raises and names the variant."""
    factory = broken(emu, "paged_decode", "wrong")
    with pytest.raises(KernelSelfTestError, match=r"paged_decode<T=float32.*mismatch.*no fallback"):
        run_case(
            make_inputs(DECODE),
            "float32",
            lambda: ops.force_backend("metal", factory, self_test="raise"),
        )


def test_use_kernels_metal_self_tests_in_raise_mode() -> None:
    with ops.use_kernels("metal"):
        assert ops._self_test_mode() == "raise"
    assert ops._self_test_mode() == "fallback"  # the machine's choice ("auto")
    with pytest.raises(ValueError, match="self_test must be"):
        with ops.force_backend("metal", self_test="warn"):
            pass


def test_a_request_completes_token_exact_despite_a_wrong_kernel(emu, warnings, tmp_path) -> None:
    """Through the engine: the decode kernel is wrong, the outputs are the fallback's."""
    from mlxserve import LLM, SamplingParams
    from tests.engine_helpers import make_tiny_model_dir

    _, model_dir = make_tiny_model_dir(tmp_path, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 9, 14, 200, 31], [7, 8, 9]]

    def generate() -> list[list[int]]:
        llm = LLM(str(model_dir), num_blocks=32, block_size=4, max_num_batched_tokens=64)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    with ops.force_backend("fallback"):
        want = generate()
    factory = broken(emu, "paged_decode", "wrong")
    with ops.force_backend("metal", factory, self_test="fallback"):
        got = generate()
    assert got == want
    (message,) = warnings()
    assert "paged_decode<" in message and "mismatch" in message
    names = {launch["name"] for launch in emu.launches}
    assert {"paged_prefill_tiled", "paged_decode"} <= names  # kernels really ran


@pytest.mark.parametrize("how", ["compile", "wrong"])
def test_a_failing_tiled_prefill_falls_back_to_the_simt_kernel(emu, warnings, how) -> None:
    """The simdgroup-matrix prefill broken: batches run on the SIMT prefill kernel (still a
    Metal kernel), exact as the fallback, with one warning saying so; doctor lists both."""
    from mlxserve.ops import selftest

    kernels = _check_twice(MIXED, broken(emu, "paged_prefill_tiled", how))
    (message,) = warnings()
    assert "Metal kernel paged_prefill_tiled<T=float32" in message
    assert "uses the SIMT prefill kernel (paged_prefill)" in message
    assert kernels.disabled == {"paged_prefill_tiled"}
    results = {r.variant.split("<")[0]: r.ok for r in kernels.self_tests.values()}
    assert results == {"paged_prefill_tiled": False, "paged_prefill": True}
    names = [launch["name"] for launch in emu.launches]
    assert names.count("paged_prefill") == 3  # its self-test, then both batches
    fresh = MetalKernels(broken(emu, "paged_prefill_tiled", how))  # as `mlxserve doctor` runs
    listed = [r.variant.split("<")[0] for r in selftest.run_all(fresh, mx.float32, 32, 4, 2)]
    assert listed == [
        "paged_decode",
        "paged_decode_split+paged_decode_reduce",
        "paged_prefill_tiled",
        "paged_prefill",
    ]
