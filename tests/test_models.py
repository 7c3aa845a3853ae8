"""Llama / Mistral / Qwen2 / Qwen3 against mlx-lm's own implementation of the same weights.

Each case is a seeded tiny random mlx-lm model saved as a checkpoint directory and loaded by
mlxserve. mlxserve runs requests batched on one flat token axis through a block pool;
mlx-lm runs each request alone with its own KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxserve.models import build_model
from mlxserve.models.fused import fuse_projections
from tests.model_helpers import (
    LLAMA3_SCALING,
    BlockPoolRunner,
    greedy_generate,
    load_checkpoint,
    make_mlx_lm_checkpoint,
    mlx_lm_chunk_logits,
    mlx_lm_greedy,
    tiny_config,
)

TOL = 1e-4  # fp32 atol and rtol


CASES: dict[str, dict[str, Any]] = {
    "llama-llama3rope-untied": tiny_config(
        "llama", num_hidden_layers=3, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING
    ),
    "llama-tied-bias-headdim-traditional-linear": tiny_config(
        "llama",
        head_dim=32,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_traditional=True,
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    "mistral": tiny_config("mistral", num_key_value_heads=1, rope_theta=1e6, sliding_window=None),
    "qwen2-tied": tiny_config("qwen2", tie_word_embeddings=True, rope_theta=1e6),
    "qwen2-untied": tiny_config("qwen2", num_hidden_layers=3, rope_theta=1e6),
    "qwen3-untied": tiny_config("qwen3", head_dim=32, rope_theta=1e6),
    "qwen3-tied": tiny_config("qwen3", head_dim=16, tie_word_embeddings=True, rope_theta=1e6),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """name -> (mlx-lm oracle model, checkpoint dir), built once per module."""
    cache: dict[str, tuple[nn.Module, Path]] = {}

    def get(name: str) -> tuple[nn.Module, Path]:
        if name not in cache:
            seed = sorted(CASES).index(name)
            cache[name] = make_mlx_lm_checkpoint(
                tmp_path_factory.mktemp(name), CASES[name], seed=seed
            )
        return cache[name]

    return get


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=what)


def check_varlen_batch(oracle: nn.Module, model: nn.Module, seed: int = 1) -> None:
    """Prefill, chunked prefill over a cached prefix and a decode, all in one step.

    step 1: B[0:9] (prefill) + C[0:6] (prefill)
    step 2: C[6] (decode) | A[0:7] (fresh prefill) | B[9:14] (chunk over 9 cached tokens)
    """
    vocab = model.vocab_size
    rng = np.random.default_rng(seed)
    a, b, c = (rng.integers(0, vocab, n).tolist() for n in (7, 14, 7))
    want_a = mlx_lm_chunk_logits(oracle, [a])
    want_b = mlx_lm_chunk_logits(oracle, [b[:9], b[9:]])
    want_c = mlx_lm_chunk_logits(oracle, [c[:6], c[6:]])

    runner = BlockPoolRunner(model, num_blocks=32, block_size=4)
    step1 = runner.step([("B", b[:9]), ("C", c[:6])], all_logits=True)
    assert_close(step1["B"], want_b[0], "B prefix")
    assert_close(step1["C"], want_c[0], "C prompt")
    step2 = runner.step([("A", a), ("B", b[9:]), ("C", c[6:])], all_logits=True, pad_to=16)
    assert_close(step2["A"], want_a[0], "A prefill")
    assert_close(step2["B"], want_b[1], "B chunk over cached prefix")
    assert_close(step2["C"], want_c[1], "C decode")

    # Same steps, LM head only on each request's last row (logits_indices).
    runner = BlockPoolRunner(model, num_blocks=32, block_size=4, seed=7)
    runner.step([("B", b[:9]), ("C", c[:6])])
    last = runner.step([("A", a), ("B", b[9:]), ("C", c[6:])])
    assert_close(last["A"], want_a[0][-1], "A last row")
    assert_close(last["B"], want_b[1][-1], "B last row")
    assert_close(last["C"], want_c[1][-1], "C last row")


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_varlen_batch_logits_match_mlx_lm(name: str, fused: bool, checkpoints) -> None:
    """Also with q/k/v and gate/up fused into one matmul each, as the engine runs them."""
    oracle, path = checkpoints(name)
    model = load_checkpoint(path)
    if fused:
        assert fuse_projections(model) == 2 * model.args.num_hidden_layers
        assert "q_proj" not in model.model.layers[0].self_attn
    check_varlen_batch(oracle, model)


@pytest.mark.parametrize("name", sorted(CASES))
def test_batched_greedy_matches_mlx_lm(name: str, checkpoints) -> None:
    oracle, path = checkpoints(name)
    model = load_checkpoint(path)
    rng = np.random.default_rng(2)
    prompts = {
        f"r{i}": rng.integers(0, model.vocab_size, n).tolist() for i, n in enumerate((5, 11, 3))
    }
    runner = BlockPoolRunner(model, num_blocks=48, block_size=4)
    # r2 joins at step 4: its prefill shares a step with the others' decodes.
    got, got_logits = greedy_generate(runner, prompts, 32, join_at={"r2": 4})
    for rid, prompt in prompts.items():
        want, want_logits = mlx_lm_greedy(oracle, prompt, 32)
        assert got[rid] == want, rid
        # Tiny random models often loop on a token, so check the logits of every step too.
        assert_close(got_logits[rid], want_logits, f"{rid} greedy logits")


def test_model_attributes(checkpoints) -> None:
    _, path = checkpoints("qwen3-untied")
    model = load_checkpoint(path)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    assert (model.vocab_size, model.max_position_embeddings) == (320, 512)
    assert model.args.model_type == "qwen3"


def test_llama3_rope_scaling_changes_the_output(checkpoints) -> None:
    """The llama3 case would pass vacuously if the scaling did nothing at test positions."""
    _, path = checkpoints("llama-llama3rope-untied")
    config = json.loads((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    tokens = list(range(1, 30))
    outs = []
    for cfg in (config, {k: v for k, v in config.items() if k != "rope_scaling"}):
        runner = BlockPoolRunner(build_model(cfg, weights), num_blocks=16, block_size=4)
        outs.append(runner.step([("r", tokens)], all_logits=True)["r"])
    assert np.abs(outs[0] - outs[1]).max() > 1e-2


QUANT_CASES = ["llama-llama3rope-untied", "qwen2-tied", "qwen3-untied"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantized_checkpoint_matches_mlx_lm(name: str, bits: int, tmp_path: Path) -> None:
    quantize = {"group_size": 64, "bits": bits}
    oracle, path = make_mlx_lm_checkpoint(tmp_path, CASES[name], seed=11, quantize=quantize)
    model = load_checkpoint(path)
    kinds = (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)
    layers = {p: m for p, m in model.named_modules() if isinstance(m, kinds)}
    config = CASES[name]
    num_expected = 7 * config["num_hidden_layers"] + 2 - config["tie_word_embeddings"]
    assert len(layers) == num_expected, sorted(layers)
    for path, module in layers.items():
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)), (path, module)
        assert (module.bits, module.group_size) == (bits, 64), path
    assert fuse_projections(model) == 2 * config["num_hidden_layers"]  # as the engine runs it
    check_varlen_batch(oracle, model)


def test_mixed_per_layer_quantization_like_gguf(tmp_path: Path) -> None:
    """group_size 32, 8-bit embedding, 4-bit projections, one layer left unquantized."""
    skip = "model.layers.1.mlp.down_proj"

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if path == skip:
            return False
        return {"group_size": 32, "bits": 8 if path.endswith("embed_tokens") else 4}

    config = CASES["qwen2-tied"]
    oracle, path = make_mlx_lm_checkpoint(
        tmp_path,
        config,
        seed=5,
        quantize={"group_size": 32, "bits": 4, "quant_predicate": predicate},
    )
    # Rewrite the config as the GGUF loader expresses it: defaults plus overrides only.
    quant = {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        skip: False,
    }
    (path / "config.json").write_text(json.dumps({**config, "quantization": quant}))
    model = load_checkpoint(path)
    embed = model.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding) and (embed.bits, embed.group_size) == (8, 32)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (4, 32)
    down = model.model.layers[1].mlp.down_proj
    assert type(down) is nn.Linear and down.weight.dtype == mx.float32
    check_varlen_batch(oracle, model)


@pytest.mark.parametrize(("dtype", "atol"), [(mx.float16, 1.5e-2), (mx.bfloat16, 8e-2)])
def test_half_precision_weights_and_cache(dtype: mx.Dtype, atol: float, checkpoints) -> None:
    """dtype= casts the weights; with a same-dtype pool the logits stay near fp32 mlx-lm."""
    oracle, path = checkpoints("qwen3-untied")
    model = load_checkpoint(path, dtype=dtype)
    tokens = list(range(5, 30))
    runner = BlockPoolRunner(model, num_blocks=16, block_size=4, dtype=dtype)
    got = runner.step([("r", tokens[:20])], all_logits=True)["r"]
    got = np.concatenate([got, runner.step([("r", tokens[20:])], all_logits=True)["r"]])
    want = mlx_lm_chunk_logits(oracle, [tokens])[0]
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
