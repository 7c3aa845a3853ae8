"""The CPU kernels with int8 activations (act_bits=8; csrc/qmm.h, csrc/q8_impl.h).

Three oracles: (1) the rounding written here by hand from qmm.h's specification (float32
as numpy computes it), exact integer dot products, then q8_impl.h's float32 sequence
replayed in numpy, which every instruction set must match bit for bit; (2) the same
products with the scales applied in float64, to float32 rounding; (3) MLX's own
dequantize + matmul on the unrounded x, within the bound the rounding allows (half a
quantum per value times the weights' magnitudes). Every int8 instruction set is forced
on in turn (a path this CPU or build lacks is skipped, saying so), on decode rows and on
the blocked matmul's many rows; a row's result must not depend on the rows beside it.
Speed: bench/q8_gemv.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.cpu import kernels as cpu
from tests.test_cpu_kernels import (
    dequantize_np,
    kernels,  # noqa: F401 -- autouse: skip without the kernels
)

ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "neon")


@pytest.fixture(params=ISAS)
def isa(request):
    name = request.param
    if not cpu.force_int8_isa(name):
        pytest.skip(f"this CPU (or this build) has no int8 {name} path")
    yield name
    cpu.force_int8_isa("auto")


def round_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """qmm.h's rounding: per block of 32, amax = max |x|, id = 127 / amax, q = rint(x * id)
    clamped to +-127 (float32 arithmetic, ties to even), d = amax / 127; zero blocks: 0."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    safe = np.where(amax == 0, np.float32(1), amax)
    inv = (np.float32(127) / safe).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32))
    q = np.where(amax[..., None] == 0, 0, np.clip(q, -127, 127)).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32)


def block_dots(x: np.ndarray, wq: mx.array, bits: int):
    """The rounded x (q, d) and the exact integer dot products per block (m, n, nb)."""
    q, d = round_rows(x)  # (m, nb, 32), (m, nb)
    raw = np.ascontiguousarray(np.array(wq).astype("<u4")).view(np.uint8)
    stream = np.unpackbits(raw, axis=1, bitorder="little")
    w = stream.reshape(raw.shape[0], -1, bits).astype(np.int64) @ (2 ** np.arange(bits))
    n, k = w.shape
    return q, d, np.einsum("mbi,nbi->mnb", q, w.reshape(n, k // 32, 32))


def exact_oracle(x: np.ndarray, wq, scales, biases, group: int, bits: int) -> np.ndarray:
    """q8_impl.h's float32 sequence, each operation rounded as numpy float32 does:
    f = f + float(dot_b) * (d_b * s_g) over the blocks in order, xs_g = the group's
    d_b * sum(q) added in order, e = e + b_g * xs_g over the groups, y = f + e."""
    q, d, dots = block_dots(x, wq, bits)
    f32 = np.float32
    s = np.array(scales.astype(mx.float32))
    b = np.array(biases.astype(mx.float32))
    subs = group // 32
    f = np.zeros(dots.shape[:2], f32)
    for blk in range(dots.shape[2]):
        ds = d[:, blk, None] * s[None, :, blk // subs]
        f = f + dots[:, :, blk].astype(f32) * ds
    dsum = d * q.sum(-1).astype(f32)  # (m, nb)
    e = np.zeros_like(f)
    for g in range(s.shape[1]):
        xs = np.zeros(len(x), f32)
        for j in range(subs):
            xs = xs + dsum[:, g * subs + j]
        e = e + b[None, :, g] * xs[:, None]
    return f + e


def integer_oracle(
    x: np.ndarray, wq: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int
):
    """y by qmm.h's formula: integer dot products per block, scales and biases in float64.
    Returns y and the sum of |terms| (the float32 rounding scale)."""
    q, d, dots = block_dots(x, wq, bits)
    s = np.repeat(np.array(scales.astype(mx.float32), np.float64), group // 32, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), np.float64), group // 32, axis=1)
    d64 = d.astype(np.float64)
    scaled = d64[:, None, :] * s[None] * dots  # (m, n, nb)
    bias = d64[:, None, :] * q.sum(-1)[:, None, :] * b[None]
    return scaled.sum(-1) + bias.sum(-1), np.abs(scaled).sum(-1) + np.abs(bias).sum(-1)


def problem(m: int, k: int, n: int, bits: int, group: int, seed: int = 0, scale_dtype=mx.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1))
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return x, wq, scales.astype(scale_dtype), biases.astype(scale_dtype)


def run(x: np.ndarray, wq, s, b, group: int, bits: int) -> np.ndarray:
    return np.array(cpu.quantized_matmul(mx.array(x), wq, s, b, group, bits, 8), np.float64)


def assert_matches_oracle(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray) -> None:
    err = np.abs(got - want)
    assert (err <= 1e-5 * magnitude + 1e-6).all(), float((err / (magnitude + 1e-9)).max())


def test_the_hand_rounding_is_what_its_docstring_says() -> None:
    x = np.zeros((1, 64), np.float32)
    x[0, :32] = np.linspace(-2.0, 1.0, 32)  # amax 2: d = 2 / 127, -2 -> -127
    q, d = round_rows(x)
    assert d[0, 0] == np.float32(2) / np.float32(127) and d[0, 1] == 0
    assert q[0, 0, 0] == -127 and q[0, 0, -1] == 64  # 1 * 63.5 -> 64 (ties to even)
    assert (q[0, 1] == 0).all()


# Decode rows, then the many rows of batches and prompts: N with tails past the tiles'
# 8 / 16 / 24 columns and the panels' 32 / 48, M past the tiles' 4 rows.
SHAPES = [(1, 96, 7), (2, 64, 33), (3, 160, 1), (4, 192, 29), (5, 128, 17), (6, 64, 50)]
SHAPES += [(7, 96, 9), (8, 320, 21), (9, 96, 13), (32, 64, 50), (33, 128, 7), (64, 192, 29)]
SHAPES += [(129, 64, 100), (1, 256, 60)]  # one row: whole vectors in place, then a partial one
SHAPES += [(1, 576, 203)]  # one row over several panels (each prefetching the next) and a tail
SHAPES += [(161, 448, 21)]  # a prompt's rows: rounded on the thread pool (qmm.c)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_integer_matmul_matches_the_oracles_and_mlx(isa: str, bits: int, group: int) -> None:
    for m, k, n in SHAPES:
        k = k // group * group or group  # a multiple of the group size (odd ones included)
        x, wq, s, b = problem(m, k, n, bits, group, seed=m * 7 + n)
        got = run(x, wq, s, b, group, bits)
        np.testing.assert_array_equal(
            got, exact_oracle(x, wq, s, b, group, bits), err_msg=f"{m}x{k}x{n}"
        )
        want, mag = integer_oracle(x, wq, s, b, group, bits)
        assert_matches_oracle(got, want, mag)
        # Against the unrounded x: each value moved by at most half its block's quantum.
        dense = dequantize_np(wq, s, b, group, bits)
        _, d = round_rows(x)
        blocks = np.abs(dense).reshape(n, k // 32, 32).sum(-1)  # (n, nb)
        bound = (d.astype(np.float64) / 2) @ blocks.T * 1.0001 + 1e-5 * mag + 1e-6
        err = np.abs(got - x.astype(np.float64) @ dense.T)
        assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_other_bit_widths(isa: str, bits: int) -> None:
    for m, k, n, group in [(1, 96, 7, 32), (3, 128, 10, 64), (8, 256, 9, 128), (37, 64, 41, 32)]:
        x, wq, s, b = problem(m, k, n, bits, group, seed=m + bits)
        got = run(x, wq, s, b, group, bits)
        np.testing.assert_array_equal(got, exact_oracle(x, wq, s, b, group, bits))
        assert_matches_oracle(got, *integer_oracle(x, wq, s, b, group, bits))


def test_16_bit_scales_and_many_rows() -> None:
    for m in (1, 3, 6, 9, 40):
        for scale_dtype in (mx.float16, mx.bfloat16):
            for n, bits in [(19, 4), (64, 4), (64, 8)]:  # whole vectors: x86 transposes float16
                x, wq, s, b = problem(m, 512, n, bits, 32, seed=m, scale_dtype=scale_dtype)
                got = run(x, wq, s, b, 32, bits)
                np.testing.assert_array_equal(got, exact_oracle(x, wq, s, b, 32, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_alone_and_beside_other_rows(isa: str, bits: int) -> None:
    """Any number of rows, any place among them: a request's logits do not depend on its
    batch, its drafts or how its prompt is chunked."""
    x, wq, s, b = problem(64, 160, 37, bits, 32, seed=4, scale_dtype=mx.float16)
    alone = np.concatenate([run(x[i : i + 1], wq, s, b, 32, bits) for i in range(64)])
    for lo, hi in [(0, 2), (0, 5), (3, 12), (0, 33), (30, 64), (0, 64)]:
        together = run(x[lo:hi], wq, s, b, 32, bits)
        np.testing.assert_array_equal(together, alone[lo:hi], err_msg=f"{isa} rows {lo}:{hi}")


def test_zero_blocks_and_non_finite_activations(isa: str) -> None:
    x, wq, s, b = problem(3, 64, 5, 8, 32, seed=1)
    x[0, :32] = 0.0  # a zero block: d = 0, contributes nothing
    x[1, 40] = np.inf  # a float matmul gives inf/NaN: so must this, not a number
    x[2, 3] = np.nan
    got = run(x, wq, s, b, 32, 8)
    want, mag = integer_oracle(x[:1], wq, s, b, 32, 8)
    assert_matches_oracle(got[:1], want, mag)
    assert np.isnan(got[1:]).all()


def test_results_do_not_depend_on_the_thread_count() -> None:
    module = cpu._module()
    x, wq, s, b = problem(8, 256, 301, 4, 64)
    outs = []
    for threads in (1, 3, 0):
        module.set_threads(threads)
        outs.append([run(x[:m], wq, s, b, 64, 4) for m in (1, 8)])
    for one, eight in outs[1:]:
        np.testing.assert_array_equal(one, outs[0][0])
        np.testing.assert_array_equal(eight, outs[0][1])


def test_act_bits_other_than_0_or_8_are_refused() -> None:
    x, wq, s, b = problem(1, 64, 5, 4, 32)
    with pytest.raises(ValueError, match="act_bits must be 0 .* or 8, got 4"):
        cpu.quantized_matmul(mx.array(x), wq, s, b, 32, 4, 4)


def test_the_setting_picks_the_layers_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.nn as nn

    from mlxserve.exceptions import ParameterError

    def act_bits() -> int:
        model = nn.Sequential(nn.Linear(64, 32))
        nn.quantize(model, group_size=32, bits=4)
        assert cpu.use_kernels(model) == 1
        return model.layers[0].act_bits

    simd = cpu._module().q8_isa() != "scalar"
    monkeypatch.delenv("MLXSERVE_CPU_INT8", raising=False)  # auto (docs/cpu-backend.md)
    assert act_bits() == (8 if simd else 0)
    for off in ("off", "0"):
        monkeypatch.setenv("MLXSERVE_CPU_INT8", off)
        assert act_bits() == 0 and "float activations" in cpu.status()
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "on")
    assert act_bits() == 8 and "int8 activations" in cpu.status()
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "auto")  # on wherever a SIMD integer path exists
    assert act_bits() == (8 if simd else 0)
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "sometimes")
    with pytest.raises(ParameterError, match="MLXSERVE_CPU_INT8 must be auto, on or off") as e:
        act_bits()
    assert e.value.parameter == "MLXSERVE_CPU_INT8"


def test_the_default_model_with_int8_activations_tracks_llamacpp(
    monkeypatch: pytest.MonkeyPatch, llamacpp_oracle: dict
) -> None:
    """llama.cpp rounds activations the same way: teacher-forced over all its greedy
    steps, its token is in our top 3 everywhere and our argmax wherever its choice is
    clear (bench/int8_agreement.py measures how much closer than the float path)."""
    from mlxserve.loader import load_model
    from tests.model_helpers import BlockPoolRunner
    from tests.paths import check_llamacpp_step

    monkeypatch.setenv("MLXSERVE_CPU_INT8", "on")
    model = load_model(skip_tokenizer_init=True).model
    assert model.model.layers[0].mlp.up_proj.act_bits == 8
    cases = llamacpp_oracle["greedy"]
    work = [
        (f"r{i}", (c["prompt_ids"] + [s["id"] for s in c["steps"]])[:-1])
        for i, c in enumerate(cases)
    ]
    logits = BlockPoolRunner(model, num_blocks=32, block_size=16).step(work, all_logits=True)
    num_clear = 0
    for i, case in enumerate(cases):
        rows = np.array(logits[f"r{i}"][len(case["prompt_ids"]) - 1 :])
        for step, row in zip(case["steps"], rows, strict=True):
            num_clear += check_llamacpp_step(step, row, case["prompt"])
    assert num_clear >= 70  # most steps are clear: the check has teeth
