"""A GGUF with K-quant and other non-native tensor types against the float model.

The file holds Q4_K and Q6_K blocks (from the numpy quantizers in gguf_helpers), Q5_0 and
Q5_1 (gguf's quantizer), repackable Q4_0 / Q8_0, an F16 embedding and F32 norms. The oracle
is mlx-lm's llama built from ``gguf.quants.dequantize`` of those exact bytes. mlxserve
re-quantizes the non-native types to MLX's affine format (groups of 32): 4 bits for Q4_K,
8 bits for Q5_x / Q6_K, so its weights differ from the oracle's by at most half an MLX
quantization step; ``gguf_keep_float`` keeps gguf's dequantized values exactly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mlxserve.cpu import kernels as cpu
from mlxserve.loader import load_model
from mlxserve.loader.gguf_quants import FLOAT16_SCALES
from tests.gguf_helpers import write_gguf
from tests.model_helpers import BlockPoolRunner, make_mlx_lm_checkpoint, mlx_lm_chunk_logits

CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,  # K-quant super-blocks are 256 wide
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 384,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
LAYER_TYPES = [
    {"q": QT.Q4_K, "k": QT.Q6_K, "v": QT.Q5_0, "o": QT.Q5_1, "gate": QT.Q4_K, "up": QT.Q6_K,
     "down": QT.Q4_K},
    {"q": QT.Q5_1, "k": QT.Q4_K, "v": QT.Q8_0, "o": QT.Q4_K, "gate": QT.Q4_0, "up": QT.Q4_K,
     "down": QT.Q6_K},
]  # fmt: skip
MLX_BITS = {QT.Q4_K: 4, QT.Q4_0: 4, QT.Q5_0: 5, QT.Q5_1: 5, QT.Q6_K: 8, QT.Q8_0: 8}
REPACKED = {QT.Q4_K, QT.Q4_0, QT.Q5_0, QT.Q5_1, QT.Q8_0}  # bit-exact; Q6_K is re-quantized
TOKENS = list(range(7, 47))


def qtypes() -> dict[str, QT]:
    """HF weight name -> GGUF type, as listed above; lm_head Q6_K as llama.cpp's Q4_K_M."""
    out = {"model.embed_tokens.weight": QT.F16, "lm_head.weight": QT.Q6_K}
    for i, layer in enumerate(LAYER_TYPES):
        for short, qtype in layer.items():
            part = "mlp" if short in ("gate", "up", "down") else "self_attn"
            out[f"model.layers.{i}.{part}.{short}_proj.weight"] = qtype
    return out


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory):
    """(gguf path, float oracle: mlx-lm llama with gguf's dequantized weights)."""
    tmp = tmp_path_factory.mktemp("kquant")
    oracle, _ = make_mlx_lm_checkpoint(tmp / "ref", CONFIG, seed=8)
    from mlx.utils import tree_flatten

    weights = {k: np.array(v) for k, v in tree_flatten(oracle.parameters())}
    expected = write_gguf(tmp / "m.gguf", CONFIG, weights, qtypes())
    oracle.load_weights([(k, mx.array(v)) for k, v in expected.items()])
    mx.eval(oracle.parameters())
    return tmp / "m.gguf", oracle, expected


def logits_of(model: nn.Module) -> np.ndarray:  # (len(TOKENS), vocab)
    return BlockPoolRunner(model, num_blocks=16, block_size=4).step([("r", TOKENS)], True)["r"]


def module_at(model: nn.Module, weight_name: str) -> nn.Module:
    """'model.layers.0.self_attn.q_proj.weight' -> that module."""
    module = model
    for part in weight_name.removesuffix(".weight").split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def effective_weight(module: nn.QuantizedLinear) -> np.ndarray:  # (out, in) float32
    """The weight a quantized layer computes with, by MLX's own dequantization.

    Scales and biases go in as float32 (exact): MLX dequantizes in their dtype, while the
    CPU kernels read 16-bit ones and compute in float32.
    """
    scales, biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)
    return np.array(mx.dequantize(module.weight, scales, biases, module.group_size, module.bits))


@pytest.fixture(scope="module")
def loaded(kquant_gguf) -> nn.Module:
    return load_model(str(kquant_gguf[0]), skip_tokenizer_init=True, cpu_dequantize=False).model


def test_layers_are_quantized_with_the_expected_bits(loaded: nn.Module) -> None:
    for name, qtype in qtypes().items():
        module = module_at(loaded, name)
        if qtype == QT.F16:
            assert type(module) is nn.Embedding, name
            continue
        assert isinstance(module, nn.QuantizedLinear), name
        bits = MLX_BITS[qtype]
        if isinstance(module, cpu.CpuQuantizedLinear):  # 5 bits stored at 8 (the same values)
            bits = cpu.STORED_BITS.get(bits, bits)
        assert (module.bits, module.group_size) == (bits, 32), name
        # CPU: float32 scales for MLX's quantized matmul; the CPU kernels keep 16-bit
        # ones as stored (the 32-value GGUF types' are float16), see cast_weights.
        kept = isinstance(module, cpu.CpuQuantizedLinear) and qtype in FLOAT16_SCALES
        assert module.scales.dtype == (mx.float16 if kept else mx.float32), name


def test_weights_are_exact_or_within_half_a_step(kquant_gguf, loaded: nn.Module) -> None:
    """Repacked types reproduce gguf's values; re-quantized ones are within half a step.

    The step of a group of 32 is (max - min) / (2^bits - 1) of gguf's values in it.
    """
    expected = kquant_gguf[2]
    for name, qtype in qtypes().items():
        if qtype == QT.F16:
            continue
        want = expected[name]
        err = np.abs(effective_weight(module_at(loaded, name)) - want).reshape(-1, 32)
        if qtype in REPACKED:
            assert err.max() <= 1e-6, (name, qtype.name, err.max())
            continue
        groups = want.reshape(-1, 32)
        half_step = (groups.max(1) - groups.min(1)) / (2 ** MLX_BITS[qtype] - 1) / 2
        assert (err <= half_step[:, None] * 1.0001 + 1e-7).all(), name
        assert err.max() > 0.1 * half_step.max()  # really re-quantized, not kept float


def test_logits_match_the_float_model_within_quantization_tolerance(
    kquant_gguf, loaded: nn.Module
) -> None:
    """Logits of the loaded model against the float model of gguf's values.

    Bound: a weight error of relative size e_i (Frobenius norm) in matrix i moves that
    layer's output by about e_i of its size; independent errors through the residual stack
    add in quadrature, so the logits move by about e = sqrt(sum e_i^2) of their RMS. The
    e_i are measured from the weights; we allow 3e, for amplification through the stack.
    """
    _, oracle, expected = kquant_gguf
    rel_errors = [
        np.linalg.norm(effective_weight(module_at(loaded, name)) - expected[name])
        / np.linalg.norm(expected[name])
        for name, qtype in qtypes().items()
        if qtype != QT.F16
    ]
    bound = 3 * float(np.sqrt(np.sum(np.square(rel_errors))))
    assert 1e-4 < bound < 0.05  # Q6_K's 8-bit re-quantization: small, not zero

    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    got = logits_of(loaded)
    rms = np.sqrt(np.mean(want**2))
    rel = np.sqrt(np.mean((got - want) ** 2)) / rms
    print(f"logits rel {rel:.2e} (bound {bound:.2e}), max abs {np.abs(got - want).max() / rms:.2e}")
    assert rel <= bound


def test_keep_float_equals_the_float_model(kquant_gguf) -> None:
    path, oracle, _ = kquant_gguf
    loaded = load_model(str(path), skip_tokenizer_init=True, gguf_keep_float=True)
    assert type(loaded.model.model.layers[0].self_attn.q_proj) is nn.Linear
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(logits_of(loaded.model), want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- each type, block by block
# Byte offsets of each block's float16 fields (scales, mins) in ggml's block layouts.
F16_FIELDS = {
    QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
    QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
}  # fmt: skip


def random_blocks(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for every field of ``qtype``'s blocks (any bytes are a valid block),
    with finite float16 scales of a weight's size: (rows, cols / block * block bytes)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scale = rng.uniform(0.5, 2.0, len(raw)) * rng.choice([-1, 1], len(raw)) / 256
        raw[:, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_each_type_is_gguf_dequantization_and_runs_in_the_kernels(qtype: QT) -> None:
    """Per GGUF type, against gguf.quants.dequantize of the same random blocks (an
    independent reader): repacked types give its values exactly, Q6_K (re-quantized to 8
    bits, groups of 32) within half an 8-bit step of each group; the layer as the CPU
    kernels run it (stored at 4 or 8 bits) equals the float matmul within float tolerance."""
    from gguf import quants

    from mlxserve.loader.gguf_quants import REPACKABLE, convert_tensor
    from tests.test_cpu_int8 import round_rows

    rows, cols = 48, 512
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    want = quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    parts = convert_tensor(raw, qtype, (rows, cols), keep_float=False)
    bits = parts["weight"].shape[-1] * 32 // cols
    layer = nn.QuantizedLinear(cols, rows, bias=False, group_size=32, bits=bits)
    layer.update(parts)
    got = effective_weight(layer)
    if qtype in REPACKABLE:
        np.testing.assert_array_equal(got, want)
    else:
        groups = want.reshape(-1, 32)
        half_step = (groups.max(1) - groups.min(1)) / 255 / 2
        assert (np.abs(got - want).reshape(-1, 32) <= half_step[:, None] * 1.0001).all()
    holder = nn.Sequential(layer)
    if not cpu.available():
        pytest.skip("CPU kernels unavailable")
    assert cpu.use_kernels(holder) == 1
    kernel_layer = holder.layers[0]
    assert kernel_layer.bits in (4, 8)  # the kernels' fast widths, same values
    np.testing.assert_array_equal(effective_weight(kernel_layer), got)
    x = np.random.default_rng(1).standard_normal((3, cols)).astype(np.float32)
    if kernel_layer.act_bits == 8:  # the kernels round activations to int8 per block
        q, d = round_rows(x)
        x = (q * d[..., None]).reshape(x.shape).astype(np.float32)
    reference = x.astype(np.float64) @ got.T.astype(np.float64)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(got).T.astype(np.float64)
    err = np.abs(np.array(kernel_layer(mx.array(x)), np.float64) - reference)
    assert (err <= 1e-5 * magnitude + 1e-6).all()
