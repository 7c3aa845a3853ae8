"""build_model / registry: strict loading errors, quantization configs, dtype, config parsing."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxserve.models import (
    KVCache,
    build_model,
    get_model_class,
    llama,
    mlx_lm_zoo,
    qwen3,
    supported_model_types,
)
from tests.model_helpers import BlockPoolRunner

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def random_weights(config: dict[str, Any], seed: int = 0) -> dict[str, mx.array]:
    """Weights with the right names and shapes (from an unloaded model of the same config)."""
    model_cls, args_cls = get_model_class(config["model_type"])
    mx.random.seed(seed)
    return dict(tree_flatten(model_cls(args_cls.from_dict(config)).parameters()))


def quantized_weights(config: dict[str, Any], group_size: int = 64, bits: int = 4):
    model_cls, args_cls = get_model_class(config["model_type"])
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    nn.quantize(model, group_size=group_size, bits=bits)
    return dict(tree_flatten(model.parameters()))


def last_logits(model: nn.Module, tokens: list[int]) -> np.ndarray:
    return BlockPoolRunner(model, num_blocks=16, block_size=4).step([("r", tokens)])["r"]


def test_registry() -> None:
    hand_written = ["llama", "mistral", "opt", "qwen2", "qwen3"]
    assert set(hand_written) < set(supported_model_types())
    assert set(supported_model_types()) - set(hand_written) == set(mlx_lm_zoo.MODEL_TYPES) - {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
    }
    assert get_model_class("mistral") == (llama.Model, llama.ModelArgs)
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt5'; supported: .*\bllama, "):
        get_model_class("gpt5")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt5'"):
        build_model({**CONFIG, "model_type": "gpt5"}, {})
    with pytest.raises(ValueError, match="no 'model_type'"):
        build_model({k: v for k, v in CONFIG.items() if k != "model_type"}, {})


def test_missing_weight() -> None:
    weights = random_weights(CONFIG)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weight model\.layers\.1\.mlp\.up_proj\.weight"):
        build_model(CONFIG, weights)


def test_unexpected_weight() -> None:
    weights = random_weights(CONFIG)
    weights["model.layers.0.self_attn.extra.weight"] = mx.zeros((4,))
    with pytest.raises(ValueError, match=r"unexpected weight model\.layers\.0\.self_attn\.extra"):
        build_model(CONFIG, weights)


def test_wrong_shape() -> None:
    weights = random_weights(CONFIG)
    weights["model.layers.0.self_attn.k_proj.weight"] = mx.zeros((64, 64))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.k_proj\.weight: expected \(32, 64\), got \(64, 64\)",
    ):
        build_model(CONFIG, weights)


def test_all_problems_reported_together_in_one_line() -> None:
    """The first problem is named, the others counted by kind."""
    weights = random_weights(CONFIG)
    del weights["model.norm.weight"]
    weights["model.bogus"] = mx.zeros((1,))
    weights["lm_head.weight"] = mx.zeros((3, 64))
    with pytest.raises(ValueError) as err:
        build_model(CONFIG, weights)
    assert str(err.value) == (
        "cannot load llama weights: missing weight model.norm.weight; "
        "and 2 more problems (1 unexpected, 1 wrong shape)"
    )


def test_config_errors() -> None:
    weights = random_weights(CONFIG)
    no_hidden = {k: v for k, v in CONFIG.items() if k != "hidden_size"}
    with pytest.raises(ValueError, match="missing required key.*hidden_size"):
        build_model(no_hidden, weights)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        build_model({**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, weights)
    with pytest.raises(ValueError, match="'llama3' needs 'factor'"):
        build_model({**CONFIG, "rope_scaling": {"rope_type": "llama3"}}, weights)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        build_model({**CONFIG, "num_key_value_heads": 3}, weights)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        build_model({**CONFIG, "hidden_act": "gelu"}, weights)


def test_sanitize_drops_rotary_tables_and_tied_head() -> None:
    config = {**CONFIG, "tie_word_embeddings": True}
    weights = random_weights(config)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.zeros((8,))
    weights["lm_head.weight"] = mx.zeros((128, 64))  # a tied duplicate some exporters write
    model = build_model(config, weights)
    assert "lm_head" not in model


def test_tie_word_embeddings_inferred_when_absent() -> None:
    config = {k: v for k, v in CONFIG.items() if k != "tie_word_embeddings"}
    untied = build_model(config, random_weights(CONFIG))
    assert isinstance(untied.lm_head, nn.Linear)
    tied = build_model(config, random_weights({**CONFIG, "tie_word_embeddings": True}))
    assert "lm_head" not in tied and tied.args.tie_word_embeddings


def test_dtype_casts_floating_parameters() -> None:
    model = build_model(CONFIG, random_weights(CONFIG), dtype=mx.bfloat16)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}
    kept = build_model(CONFIG, random_weights(CONFIG))
    assert {v.dtype for _, v in tree_flatten(kept.parameters())} == {mx.float32}


def test_quantization_scales_keep_dtype_unless_dtype_given() -> None:
    weights = quantized_weights(CONFIG)
    weights = {
        k: v.astype(mx.bfloat16) if k.endswith((".scales", ".biases")) else v
        for k, v in weights.items()
    }
    config = {**CONFIG, "quantization": {"group_size": 64, "bits": 4}}
    kept = build_model(config, weights)
    q_proj = kept.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    assert (q_proj.scales.dtype, q_proj.biases.dtype) == (mx.bfloat16, mx.bfloat16)
    assert kept.model.norm.weight.dtype == mx.float32
    cast = build_model(config, weights, dtype=mx.float16)
    q_proj = cast.model.layers[0].self_attn.q_proj
    assert (q_proj.weight.dtype, q_proj.scales.dtype) == (mx.uint32, mx.float16)
    assert cast.model.norm.weight.dtype == mx.float16


def test_quantization_config_key_alone_is_read() -> None:
    weights = quantized_weights(CONFIG, group_size=32, bits=8)
    model = build_model({**CONFIG, "quantization_config": {"group_size": 32, "bits": 8}}, weights)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, nn.QuantizedLinear) and (layer.group_size, layer.bits) == (32, 8)


def test_quantization_errors() -> None:
    weights = quantized_weights(CONFIG)
    with pytest.raises(
        ValueError, match=r"quantized \(e\.g\. lm_head\.scales\).*no 'quantization'"
    ):
        build_model(CONFIG, weights)
    marked_off = {"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": False}
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.scales .* not quantized"
    ):
        build_model({**CONFIG, "quantization": marked_off}, weights)
    # Wrong bits in the config: the packed shapes disagree and strict loading names them.
    with pytest.raises(ValueError, match=r"wrong shape for lm_head\.weight"):
        build_model({**CONFIG, "quantization": {"group_size": 64, "bits": 8}}, weights)
    hf_gptq = {"quant_method": "gptq", "desc_act": False}
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        build_model({**CONFIG, "quantization_config": hf_gptq}, weights)


def test_context_length_and_sliding_window() -> None:
    mistral_v01 = {**CONFIG, "model_type": "mistral", "sliding_window": 64}
    assert build_model(mistral_v01, random_weights(CONFIG)).max_position_embeddings == 64
    qwen2 = {**CONFIG, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}
    assert build_model(qwen2, random_weights(qwen2)).max_position_embeddings == 256
    no_limit = {k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}
    assert build_model(no_limit, random_weights(CONFIG)).max_position_embeddings is None


def test_rope_parameters_match_classic_keys() -> None:
    """transformers 5 nests rope_theta and the scaling under rope_parameters."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}
    classic = {**CONFIG, "rope_theta": 5e5, "rope_scaling": scaling}
    nested = {k: v for k, v in CONFIG.items() if k != "rope_theta"}
    nested["rope_parameters"] = {**scaling, "rope_theta": 5e5}
    weights = random_weights(CONFIG)
    tokens = list(range(3, 40))
    a = last_logits(build_model(classic, weights), tokens)
    b = last_logits(build_model(nested, weights), tokens)
    c = last_logits(build_model(CONFIG, weights), tokens)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3
    # Dynamic NTK only changes the base past max_position_embeddings, the context the
    # model reports: inside it, it is plain RoPE.
    dynamic = {**CONFIG, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    np.testing.assert_array_equal(last_logits(build_model(dynamic, weights), tokens), c)


def test_qwen3_head_dim_default_and_kv_cache_allocate() -> None:
    config = {**CONFIG, "model_type": "qwen3", "hidden_size": 64}
    args = qwen3.ModelArgs.from_dict(config)
    assert args.head_dim == 128  # HF Qwen3Config's default
    cache = KVCache.allocate(3, 10, 4, 2, 16, mx.bfloat16)
    assert (cache.num_layers, cache.num_blocks, cache.block_size) == (3, 10, 4)
    assert cache.keys[2].shape == (10, 4, 2, 16) and cache.values[0].dtype == mx.bfloat16
