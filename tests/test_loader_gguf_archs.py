"""GGUF files of each architecture against the same model from safetensors or mlx-lm.

Tiny random mlx-lm models are written to GGUF as llama.cpp's converter would (its tensor
names from the gguf package, llama Q/K rows permuted, F32/F16 tensors, no vocab_size key)
and loaded with ``load_model``. Equal logits prove the name mapping, the choice of which
architectures to un-permute, and the config read from the metadata.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mlxserve.loader import load_model
from mlxserve.loader.gguf import make_config
from mlxserve.models.layers import llama3_inv_freq
from tests.gguf_helpers import write_gguf
from tests.model_helpers import (
    LLAMA3_SCALING,
    BlockPoolRunner,
    make_mlx_lm_checkpoint,
    mlx_lm_chunk_logits,
    tiny_config,
)

TOKENS = list(range(3, 43))  # 40 positions: long enough for every RoPE band to matter


def logits_of(model, tokens: list[int] = TOKENS) -> np.ndarray:  # (len(tokens), vocab)
    return BlockPoolRunner(model, num_blocks=16, block_size=4).step([("r", tokens)], True)["r"]


def f16_rounded(model) -> dict[str, np.ndarray]:
    """The model's weights rounded through float16, so F16 and F32 tensors store them exactly."""
    from mlx.utils import tree_flatten

    return {
        k: np.array(v.astype(mx.float16).astype(mx.float32))
        for k, v in tree_flatten(model.parameters())
    }


ARCH_CASES = {
    "llama": tiny_config("llama", rope_theta=5e5),
    "qwen2-tied": tiny_config("qwen2", tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": tiny_config("qwen3", head_dim=32, rope_theta=1e6),
}


@pytest.mark.parametrize("name", sorted(ARCH_CASES))
def test_gguf_equals_safetensors(name: str, tmp_path: Path) -> None:
    config = ARCH_CASES[name]
    oracle, _ = make_mlx_lm_checkpoint(tmp_path / "ref", config, seed=3)
    weights = f16_rounded(oracle)
    oracle.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    # Embeddings and layer 0 as F16 (as converters write them), everything else F32.
    qtypes = {k: QT.F16 for k in weights if "embed" in k or (".layers.0." in k and "proj.w" in k)}
    write_gguf(tmp_path / "m.gguf", config, weights, qtypes)
    got = load_model(str(tmp_path / "m.gguf"), skip_tokenizer_init=True)
    assert got.config["vocab_size"] == 320  # from token_embd's rows: no <arch>.vocab_size
    assert got.config.get("rope_scaling") is None
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(logits_of(got.model), want, atol=1e-4, rtol=1e-4)


def llamacpp_rope_factors(head_dim: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for llama3 rope scaling.

    Per frequency: 1 where the wavelength is short (kept), ``factor`` where it is long
    (slowed), and 1 / ((1 - s) / factor + s) in between, s the linear blend weight.
    """
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            s = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def test_rope_freqs_tensor_equals_hf_llama3_scaling(tmp_path: Path) -> None:
    config = tiny_config("llama", rope_theta=5e5, rope_scaling=LLAMA3_SCALING)
    oracle, _ = make_mlx_lm_checkpoint(tmp_path / "ref", config, seed=4)
    factors = llamacpp_rope_factors(16, 5e5, LLAMA3_SCALING)
    bands = sorted(set(factors.tolist()))  # kept (1), blended (between), scaled (8)
    assert len(bands) == 3 and bands[0] == 1.0 and 1.0 < bands[1] < 8.0 and bands[2] == 8.0
    # The same frequencies as transformers' llama3 formula (as mlxserve implements it).
    plain = 1.0 / 5e5 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(plain / factors, llama3_inv_freq(16, 5e5, LLAMA3_SCALING), rtol=1e-6)

    weights = f16_rounded(oracle)
    oracle.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    no_scaling = {k: v for k, v in config.items() if k != "rope_scaling"}
    path = tmp_path / "m.gguf"
    write_gguf(path, no_scaling, weights, extra_tensors={"rope_freqs.weight": factors})
    got = load_model(str(path), skip_tokenizer_init=True)
    assert got.config["rope_scaling"]["rope_type"] == "freq_factors"
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(logits_of(got.model), want, atol=1e-4, rtol=1e-4)

    write_gguf(tmp_path / "plain.gguf", no_scaling, weights)
    plain_model = load_model(str(tmp_path / "plain.gguf"), skip_tokenizer_init=True)
    assert np.abs(logits_of(plain_model.model) - want).max() > 1e-2  # the factors matter


def test_linear_rope_scaling_metadata(tmp_path: Path) -> None:
    config = tiny_config("llama", rope_scaling={"type": "linear", "factor": 4.0})
    oracle, _ = make_mlx_lm_checkpoint(tmp_path / "ref", config, seed=6)
    weights = f16_rounded(oracle)
    oracle.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    path = tmp_path / "m.gguf"
    write_gguf(path, config, weights, metadata=meta, write_vocab_size=True)
    got = load_model(str(path), skip_tokenizer_init=True)
    assert got.config["rope_scaling"] == {"type": "linear", "factor": 4.0}
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(logits_of(got.model), want, atol=1e-4, rtol=1e-4)


META = {
    "general.architecture": "llama",
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
}


EMBD = {"token_embd.weight": (10, 64)}
X = Path("x.gguf")


def test_rope_scaling_other_than_linear_is_named() -> None:
    yarn = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 4096,
    }
    with pytest.raises(
        ValueError,
        match=r"x\.gguf: unsupported RoPE scaling llama\.rope\.scaling\.type = 'yarn'; "
        r"supported: none, linear",
    ):
        make_config(META | yarn, EMBD, X)
    with pytest.raises(ValueError, match="'linear' but no factor"):
        make_config(META | {"llama.rope.scaling.type": "linear"}, EMBD, X)
    legacy = make_config(META | {"llama.rope.scale_linear": 2.0}, EMBD, X)
    assert legacy["rope_scaling"] == {"type": "linear", "factor": 2.0}


def test_vocab_size_fallbacks() -> None:
    assert make_config(META | {"llama.vocab_size": 7}, EMBD, X)["vocab_size"] == 7
    assert make_config(META, EMBD, X)["vocab_size"] == 10  # token_embd's rows
    tokens = {"tokenizer.ggml.tokens": ["a", "b", "c"]}
    assert make_config(META | tokens, {}, X)["vocab_size"] == 3
    with pytest.raises(ValueError, match=r"x\.gguf: no llama\.vocab_size, token_embd\.weight"):
        make_config(META, {}, X)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("llama.attention.head_count", 0, "= 0 is not a positive int"),
        ("llama.embedding_length", "64", "= '64' is not a positive int"),
        ("llama.attention.layer_norm_rms_epsilon", -1.0, "= -1.0 is not a positive float"),
        ("llama.vocab_size", True, "= True is not a positive int"),
        ("llama.rope.dimension_count", 8, "= 8 differs from the head size 16; partial rotary"),
    ],
)
def test_bad_metadata_values_are_named(key: str, value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=rf"^x\.gguf: {re.escape(key)} {re.escape(problem)}"):
        make_config(META | {key: value}, EMBD, X)
