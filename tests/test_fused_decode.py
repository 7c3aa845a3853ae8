"""Fused projections and the CPU-compiled decoder pieces against what they replace.

Oracles: the separate layers' own matmuls (and MLX's dequantize + matmul) for the fused
layers; ``mx.fast.rope`` / ``mx.fast.rms_norm`` / ``nn.silu(g) * u`` for the compiled
pieces, bit for bit (they must compute the same values, not close ones).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxserve.cpu import kernels as cpu
from mlxserve.loader import load_model
from mlxserve.models import compiled
from mlxserve.models.fused import fuse_linears, fuse_projections
from mlxserve.models.layers import RMSNorm, RotaryEmbedding
from tests.model_helpers import make_mlx_lm_checkpoint, tiny_config
from tests.test_cpu_int8 import round_rows


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config("qwen2", num_hidden_layers=2)  # q/k/v with biases
    _, path = make_mlx_lm_checkpoint(
        tmp_path_factory.mktemp("q4"), config, seed=3, quantize={"group_size": 32, "bits": 4}
    )
    return path


def test_fused_cpu_kernel_layers_equal_the_separate_ones(quantized_dir: Path) -> None:
    """As the engine loads a quantized model on the CPU: kernels, then fusion."""
    model = load_model(str(quantized_dir), skip_tokenizer_init=True).model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    separate = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    x = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(0))
    want = [layer(x) for layer in separate]
    # Independent of every kernel: MLX's dequantize, a float matmul, the bias (on x
    # rounded as qmm.h says when the layers round activations: MLXSERVE_CPU_INT8=on).
    xr = x
    if getattr(attn.q_proj, "act_bits", 0) == 8:
        q, d = round_rows(np.array(x))
        xr = mx.array((q * d[..., None]).reshape(x.shape).astype(np.float32))
    reference = [
        xr @ mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).T
        + (m.bias if "bias" in m else 0)
        for m in separate
    ]
    assert fuse_projections(model) == 4
    assert "q_proj" not in attn and "gate_proj" not in mlp
    if cpu.available():
        assert type(attn.qkv_proj) is cpu.CpuQuantizedLinear
    q, k, v = mx.split(attn.qkv_proj(x), attn._qkv_split, axis=-1)
    gate, up = mx.split(mlp.gate_up_proj(x), 2, axis=-1)
    got_all = [q, k, v, gate, up]
    for name, got, exact, ref in zip(
        "q k v gate up".split(), got_all, want, reference, strict=True
    ):
        # Row n of the fused product is computed as row n of its own layer: bit for bit.
        assert mx.array_equal(got, exact).item(), name
        assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4).item(), name
    assert fuse_projections(model) == 0  # idempotent


def test_layers_that_differ_stay_separate() -> None:
    mx.random.seed(0)
    a, b = nn.Linear(32, 64), nn.Linear(32, 16)
    qa = nn.QuantizedLinear.from_linear(a, group_size=32, bits=4)
    qb_g64 = nn.QuantizedLinear.from_linear(nn.Linear(64, 16), group_size=64, bits=4)
    assert fuse_linears([qa, qb_g64]) is None  # group size / input width differ
    assert fuse_linears([a, nn.Linear(32, 16, bias=False)]) is None  # bias on one only
    assert fuse_linears([a, qa]) is None  # float and quantized
    fused = fuse_linears([a, b])
    x = mx.random.normal((3, 32))
    assert mx.allclose(fused(x), mx.concatenate([a(x), b(x)], axis=-1), atol=1e-6).item()


def test_layers_of_different_widths_fuse_at_the_widest_exactly() -> None:
    """A GGUF Q4_K_M layer's q/k/v: Q5_0 (5 bits, float16 scales), Q4_K (4 bits, float32)
    and Q8_0 (8 bits, float16) rows fuse into one 8-bit layer with float32 scales whose
    dequantized rows are the separate layers' own, value for value."""
    layers = []
    for i, (rows, bits, dtype) in enumerate(
        [(64, 5, mx.float16), (16, 4, mx.float32), (16, 8, mx.float16)]
    ):
        layer = nn.QuantizedLinear.from_linear(nn.Linear(64, rows), group_size=32, bits=bits)
        layer.scales, layer.biases = layer.scales.astype(dtype), layer.biases.astype(dtype)
        layer.bias = mx.random.normal((rows,), key=mx.random.key(i))
        layers.append(layer)
    fused = fuse_linears(layers)
    assert fused is not None and fused.bits == 8 and fused.scales.dtype == mx.float32
    # Values as the kernels compute them: scale * q + bias in float32.
    want = mx.concatenate(
        [
            mx.dequantize(
                m.weight, *(a.astype(mx.float32) for a in (m.scales, m.biases)), 32, m.bits
            )
            for m in layers
        ]
    )
    got = mx.dequantize(fused.weight, fused.scales, fused.biases, 32, 8)
    assert mx.array_equal(got, want).item()
    x = mx.random.normal((3, 64), key=mx.random.key(9))
    separate = mx.concatenate([(x @ w.T) for w in mx.split(want, [64, 80])], axis=-1)
    separate = separate + mx.concatenate([m.bias for m in layers])
    assert mx.allclose(fused(x), separate, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    "scaling", [None, {"type": "linear", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0}]
)
@pytest.mark.parametrize("dims", [64, 32])  # 32: partial rotation of 64-wide heads
def test_cpu_rope_is_mx_fast_rope_bit_for_bit(traditional, scaling, dims) -> None:
    rope = RotaryEmbedding(dims, 10000.0, traditional, scaling)
    x = mx.random.normal((7, 3, 64), key=mx.random.key(1))
    positions = mx.array([0, 1, 5, 40, 300, 4095, 100000], dtype=mx.int32)

    def oracle(y: mx.array) -> mx.array:
        return mx.fast.rope(
            y[:, :, None, :],
            dims,
            traditional=traditional,
            base=rope._base,
            scale=rope._scale,
            offset=positions,
            freqs=rope._freqs,
        )[:, :, 0, :]

    with mx.stream(mx.cpu):
        got = rope(x, positions)
        again = rope(x * 2, positions)  # the step's tables, reused by the next layer
    assert mx.array_equal(got, oracle(x)).item()
    assert mx.array_equal(again, oracle(x * 2)).item()


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_compiled_norm_and_swiglu_are_the_ops_bit_for_bit(rows: int) -> None:
    key = mx.random.key(rows)
    x = mx.random.normal((rows, 96), key=key) * 3
    norm = RMSNorm(96, eps=1e-5)
    norm.weight = mx.random.uniform(shape=(96,), key=key)
    with mx.stream(mx.cpu):
        assert mx.array_equal(norm(x), mx.fast.rms_norm(x, norm.weight, 1e-5)).item()
        gate, up = x * 2, mx.flip(x, axis=-1)
        assert mx.array_equal(compiled.swiglu(gate, up), nn.silu(gate) * up).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_cpu_rope_and_norm_in_16_bit_are_the_ops_bit_for_bit(dtype) -> None:
    """16-bit activations: each product rounded to the dtype, as MLX's ops round them."""
    rope = RotaryEmbedding(64, 10000.0, False, None)
    x = mx.random.normal((5, 3, 64), key=mx.random.key(2)).astype(dtype)
    positions = mx.array([0, 3, 40, 999, 70000], dtype=mx.int32)
    norm = RMSNorm(64, eps=1e-5)
    norm.weight = mx.random.uniform(shape=(64,), key=mx.random.key(3)).astype(dtype)
    with mx.stream(mx.cpu):
        want = mx.fast.rope(x[:, :, None, :], 64, traditional=False, base=10000.0, scale=1.0,
                            offset=positions)[:, :, 0, :]  # fmt: skip
        assert mx.array_equal(rope(x, positions), want).item()
        assert mx.array_equal(norm(x[:, 0]), mx.fast.rms_norm(x[:, 0], norm.weight, 1e-5)).item()


def test_split_rotate_of_a_fused_projection_is_rope_of_each_part() -> None:
    """q | k | v in one row (a fused projection) split into heads, q and k rotated, v as
    is: what the separate split, reshapes and ``rope`` calls give, bit for bit."""
    rope = RotaryEmbedding(32, 500000.0, True, {"rope_type": "llama3", "factor": 8.0})
    x = mx.random.normal((4, (6 + 2 + 2) * 48), key=mx.random.key(4))  # partial rotation
    positions = mx.array([7, 8, 9, 2000], dtype=mx.int32)
    with mx.stream(mx.cpu):
        q, k, v = rope.split_rotate(x, positions, (6, 2, 2), (48, 48, 48), 2)
        parts = mx.split(x, [6 * 48, 8 * 48], axis=-1)
        want = [p.reshape(4, -1, 48) for p in parts]
        want[0], want[1] = (
            mx.fast.rope(w[:, :, None, :], 32, traditional=True, base=None, scale=1.0,
                         offset=positions, freqs=rope._freqs)[:, :, 0, :]
            for w in want[:2]
        )  # fmt: skip
    for got, expected in zip((q, k, v), want, strict=True):
        assert got.shape == expected.shape and mx.array_equal(got, expected).item()
