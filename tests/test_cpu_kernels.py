"""mlxserve's CPU quantized matmul kernels against MLX's own dequantize + matmul.

Every instruction-set path is forced on in turn (a path this CPU or build lacks is
skipped, saying so); shapes cover decode rows (the GEMV), batches and prefill (the GEMM),
K an odd multiple of the group size and N odd. Speed is measured in bench/matmul.py.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxserve.cpu import kernels as cpu

ISAS = ("scalar", "avx2", "avx512", "neon")


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not cpu.available():
        if os.environ.get("MLXSERVE_REQUIRE_CPU_KERNELS"):
            pytest.fail(f"MLXSERVE_REQUIRE_CPU_KERNELS is set: {cpu.status()}")
        pytest.skip(cpu.status())


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the float path: layers made here keep x as given (the int8
    path, MLXSERVE_CPU_INT8, is tested in tests/test_cpu_int8.py)."""
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "off")


@pytest.fixture(params=ISAS)
def isa(request):
    name = request.param
    if not cpu.force_isa(name):
        pytest.skip(f"this CPU (or this build) has no {name} path")
    yield name
    cpu.force_isa("auto")


def dequantize_np(wq: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int):
    """MLX's affine format unpacked by hand in float64: each row of uint32 words is a
    little-endian bit stream, value k at bits [k * bits, (k + 1) * bits), times its group's
    scale, plus its bias."""
    raw = np.ascontiguousarray(np.array(wq).astype("<u4")).view(np.uint8)  # (n, words * 4)
    stream = np.unpackbits(raw, axis=1, bitorder="little")  # (n, K * bits)
    q = stream.reshape(raw.shape[0], -1, bits).astype(np.float64) @ (2.0 ** np.arange(bits))
    s = np.repeat(np.array(scales.astype(mx.float32), np.float64), group, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), np.float64), group, axis=1)
    return q * s + b


def problem(m: int, k: int, n: int, bits: int, group: int, scale_dtype=mx.float32, seed=0):
    """x (m, k), quantized w (n, k) and the float64 oracle x @ dequantize(w).T."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    dense = dequantize_np(wq, scales, biases, group, bits)
    xs = np.array(x, np.float64)
    return x, (wq, scales, biases), xs @ dense.T, np.abs(xs) @ np.abs(dense).T


def test_the_hand_unpacking_oracle_agrees_with_mlx_dequantize() -> None:
    for bits, group in [(2, 32), (3, 64), (4, 32), (5, 32), (6, 128), (8, 64)]:
        w = mx.random.normal((6, 256))
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
        mine = dequantize_np(wq, s, b, group, bits)
        theirs = np.array(mx.dequantize(wq, s, b, group_size=group, bits=bits), np.float64)
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def assert_close(got: mx.array, want: np.ndarray, magnitude: np.ndarray) -> None:
    # float32 sums in another order: error within a few ulps of the sum of |terms|.
    err = np.abs(np.array(got, np.float64) - want)
    assert (err <= 1e-5 * magnitude + 1e-6).all(), float((err / (magnitude + 1e-9)).max())


SHAPES = [(1, 96, 7), (2, 64, 33), (3, 160, 1), (5, 128, 17), (8, 96, 40), (9, 64, 13)]
SHAPES += [(16, 192, 29), (17, 64, 50), (33, 96, 9), (64, 320, 21)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_kernels_match_dequantize_then_matmul(isa: str, bits: int, group: int) -> None:
    for m, k, n in SHAPES:
        k = k // group * group or group  # a multiple of the group size (odd ones included)
        x, (wq, s, b), want, mag = problem(m, k, n, bits, group, seed=m * 7 + n)
        assert_close(cpu.quantized_matmul(x, wq, s, b, group, bits), want, mag)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_other_bit_widths_match_dequantize_then_matmul(isa: str, bits: int) -> None:
    # The GGUF loader makes 5-bit layers (Q5_0, Q5_1, Q5_K); mlx-community ships 2/3/6.
    for m, k, n, group in [(1, 96, 7, 32), (3, 128, 10, 64), (12, 256, 9, 128), (40, 64, 5, 32)]:
        x, (wq, s, b), want, mag = problem(m, k, n, bits, group, seed=m + bits)
        assert_close(cpu.quantized_matmul(x, wq, s, b, group, bits), want, mag)


@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
def test_16_bit_scales_and_biases_are_read_as_stored(isa: str, scale_dtype) -> None:
    for m, k, n in [(1, 96, 11), (4, 64, 3), (20, 128, 25)]:
        x, (wq, s, b), want, mag = problem(m, k, n, 4, 32, scale_dtype, seed=m)
        assert_close(cpu.quantized_matmul(x, wq, s, b, 32, 4), want, mag)


def test_a_row_gets_the_same_bits_alone_and_beside_other_rows(isa: str) -> None:
    """Decode rows (the GEMV: up to MV_ROWS rows, csrc/qmm_<isa>.c) sum in the same order
    whatever the row count, so a request's logits do not depend on its batch or drafts."""
    mv_rows = {"scalar": 4, "avx2": 4, "avx512": 8, "neon": 8}[isa]
    x, (wq, scales, biases), _, _ = problem(8, 160, 37, 4, 32, mx.float16, seed=4)
    alone = [cpu.quantized_matmul(x[i : i + 1], wq, scales, biases, 32, 4) for i in range(8)]
    for m in range(2, mv_rows + 1):
        together = cpu.quantized_matmul(x[:m], wq, scales, biases, 32, 4)
        for i in range(m):
            assert mx.array_equal(together[i : i + 1], alone[i]).item(), (isa, m, i)


def test_agrees_with_mlx_quantized_matmul_and_group_128() -> None:
    cases = [(1, 4, 128), (40, 8, 128), (3, 4, 64), (1, 5, 32), (17, 3, 64), (2, 6, 32)]
    for m, bits, group in cases + [(9, 2, 128)]:
        x, (wq, s, b), _, mag = problem(m, 256, 19, bits, group, seed=bits + m)
        want = np.array(mx.quantized_matmul(x, wq, s, b, True, group, bits), np.float64)
        assert_close(cpu.quantized_matmul(x, wq, s, b, group, bits), want, mag)


def test_leading_dimensions_views_and_dtypes() -> None:
    x, (wq, s, b), want, mag = problem(6, 64, 10, 4, 32)
    got = cpu.quantized_matmul(x.reshape(2, 3, 64), wq, s, b, 32, 4)
    assert got.shape == (2, 3, 10)
    assert_close(got.reshape(6, 10), want, mag)
    # A non-contiguous x (a transposed copy's transpose) reads the same values.
    xt = mx.array(np.ascontiguousarray(np.array(x).T)).T
    assert_close(cpu.quantized_matmul(xt, wq, s, b, 32, 4), want, mag)
    sliced = cpu.quantized_matmul(mx.concatenate([x, x], axis=1)[:, :64], wq, s, b, 32, 4)
    assert_close(sliced, want, mag)
    half = cpu.quantized_matmul(x.astype(mx.float16), wq, s, b, 32, 4)
    assert half.dtype == mx.float16
    np.testing.assert_allclose(np.array(half, np.float64), want, rtol=2e-2, atol=0.1)


def test_results_do_not_depend_on_the_thread_count() -> None:
    module = cpu._module()
    x, (wq, s, b), _, _ = problem(40, 256, 301, 4, 64)
    x1 = x[:1]
    outs = []
    for threads in (1, 3, 0):
        module.set_threads(threads)
        outs.append(
            (
                np.array(cpu.quantized_matmul(x, wq, s, b, 64, 4)),
                np.array(cpu.quantized_matmul(x1, wq, s, b, 64, 4)),
            )
        )
    for big, one in outs[1:]:
        np.testing.assert_array_equal(big, outs[0][0])
        np.testing.assert_array_equal(one, outs[0][1])


def test_lazy_and_inside_mx_compile() -> None:
    x, (wq, s, b), want, mag = problem(4, 64, 12, 8, 32)

    @mx.compile
    def layer(x):
        return mx.maximum(cpu.quantized_matmul(x * 2, wq, s, b, 32, 8), 0.0)

    assert_close(layer(x), np.maximum(2 * want, 0.0), 2 * mag)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 7}, "bits must be 2, 3, 4, 5, 6 or 8"),
        ({"group_size": 48}, "group_size must be a multiple of 32"),
        ({"x": mx.zeros((2, 65))}, "last dimension must be 64"),
        ({"scales": mx.zeros((5, 1))}, "scales and biases must have shape"),
        ({"biases": mx.zeros((5, 2), dtype=mx.float16)}, "share a float32/float16/bfloat16"),
        ({"w": mx.zeros((5, 8), dtype=mx.int32)}, "w must be a 2-D uint32 array"),
    ],
)
def test_bad_arguments_are_refused_naming_the_problem(kwargs: dict, message: str) -> None:
    x, (wq, s, b), _, _ = problem(2, 64, 5, 4, 32)
    args = {"x": x, "w": wq, "scales": s, "biases": b, "group_size": 32, "bits": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        cpu.quantized_matmul(**args)


def test_use_kernels_swaps_supported_layers_and_keeps_the_others() -> None:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64), nn.Linear(64, 64))
    nn.quantize(model, group_size=32, bits=5, class_predicate=lambda p, m: p != "layers.2")
    model.layers[1] = nn.QuantizedLinear.from_linear(nn.Linear(32, 64), 32, 4, mode="mxfp4")
    experts = QuantizedSwitchLinear(64, 32, num_experts=2, group_size=32, bits=4)
    experts.scales = experts.scales.astype(mx.bfloat16)
    model.layers.append(experts)
    x = mx.random.normal((3, 64))
    want = model.layers[2](model.layers[1](model.layers[0](x)))
    assert cpu.use_kernels(model) == 1
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["CpuQuantizedLinear", "QuantizedLinear", "Linear", "QuantizedSwitchLinear"]
    assert model.layers[1].scales.dtype == mx.uint8  # mxfp4's own scales, untouched
    # MLX's own CPU quantized ops get float32 scales (~10x faster than 16-bit ones).
    assert experts.scales.dtype == mx.float32
    got = model.layers[2](model.layers[1](model.layers[0](x)))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_quantized_embedding_lookups_keep_the_activation_dtype() -> None:
    emb = nn.QuantizedEmbedding(100, 64, group_size=32, bits=8)
    emb.scales, emb.biases = emb.scales.astype(mx.float16), emb.biases.astype(mx.float16)
    dense = dequantize_np(emb.weight, emb.scales, emb.biases, 32, 8)
    ids = mx.array([[3, 7, 99]])
    h = mx.random.normal((1, 3, 64))
    holder = nn.Sequential(emb)
    assert cpu.use_kernels(holder, mx.float32) == 1
    emb = holder.layers[0]
    assert emb(ids).dtype == mx.float32
    np.testing.assert_allclose(np.array(emb(ids))[0], dense[[3, 7, 99]], rtol=1e-6, atol=1e-6)
    mag = np.abs(np.array(h[0], np.float64)) @ np.abs(dense).T
    assert_close(emb.as_linear(h)[0], np.array(h[0], np.float64) @ dense.T, mag)
