"""OPT against a numpy reference written from the published architecture (HF OPTForCausalLM).

The reference runs one request's whole sequence densely in float64; mlxserve runs a varlen
batch (prefill, chunk over a cached prefix, decode) through the block pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.model_helpers import BlockPoolRunner, load_checkpoint, save_checkpoint

TOL = 1e-4


def opt_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "model_type": "opt",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "ffn_dim": 128,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "max_position_embeddings": 64,
        "do_layer_norm_before": True,
        "word_embed_proj_dim": 64,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "pad_token_id": 1,
    }
    config.update(overrides)
    return config


def random_opt_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights under HF's OPT parameter names (fairseq-style ``decoder.*`` prefix)."""
    rng = np.random.default_rng(seed)
    dim, ffn, embed_dim = config["hidden_size"], config["ffn_dim"], config["word_embed_proj_dim"]

    def linear(name: str, n_in: int, n_out: int, bias: bool = True) -> None:
        w[f"{name}.weight"] = rng.normal(0, n_in**-0.5, (n_out, n_in))
        if bias:
            w[f"{name}.bias"] = rng.normal(0, 0.1, n_out)

    def layer_norm(name: str, n: int) -> None:
        w[f"{name}.weight"] = 1 + rng.normal(0, 0.2, n)
        w[f"{name}.bias"] = rng.normal(0, 0.1, n)

    w: dict[str, np.ndarray] = {}
    w["decoder.embed_tokens.weight"] = rng.normal(0, 0.5, (config["vocab_size"], embed_dim))
    w["decoder.embed_positions.weight"] = rng.normal(
        0, 0.5, (config["max_position_embeddings"] + 2, dim)
    )
    if embed_dim != dim:
        linear("decoder.project_in", embed_dim, dim, bias=False)
        linear("decoder.project_out", dim, embed_dim, bias=False)
    for i in range(config["num_hidden_layers"]):
        p = f"decoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{p}.self_attn.{proj}", dim, dim)
        layer_norm(f"{p}.self_attn_layer_norm", dim)
        linear(f"{p}.fc1", dim, ffn)
        linear(f"{p}.fc2", ffn, dim)
        layer_norm(f"{p}.final_layer_norm", dim)
    if config["do_layer_norm_before"]:
        layer_norm("decoder.final_layer_norm", dim)
    return {k: v.astype(np.float32) for k, v in w.items()}


def reference_logits(
    w: dict[str, np.ndarray],
    config: dict[str, Any],
    tokens: list[int],
    lm_head: np.ndarray | None = None,
) -> np.ndarray:
    """(len(tokens), vocab) logits of one sequence, float64, plain causal attention.

    The LM head is the token embedding (tied) unless ``lm_head`` is given.
    """
    w = {k: v.astype(np.float64) for k, v in w.items()}
    heads, pre_norm = config["num_attention_heads"], config["do_layer_norm_before"]
    n = len(tokens)

    def lin(name, x, bias=True):
        return x @ w[f"{name}.weight"].T + (w[f"{name}.bias"] if bias else 0)

    def ln(name, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def attention(p, x):
        d = x.shape[-1] // heads
        q = lin(f"{p}.q_proj", x).reshape(n, heads, d) * d**-0.5
        k = lin(f"{p}.k_proj", x).reshape(n, heads, d)
        v = lin(f"{p}.v_proj", x).reshape(n, heads, d)
        scores = np.einsum("qhd,khd->hqk", q, k)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return lin(f"{p}.out_proj", np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))

    x = w["decoder.embed_tokens.weight"][tokens]
    if "decoder.project_in.weight" in w:
        x = lin("decoder.project_in", x, bias=False)
    x = x + w["decoder.embed_positions.weight"][np.arange(n) + 2]  # learned, offset 2
    for i in range(config["num_hidden_layers"]):
        p = f"decoder.layers.{i}"
        h = attention(f"{p}.self_attn", ln(f"{p}.self_attn_layer_norm", x) if pre_norm else x)
        x = x + h
        if not pre_norm:
            x = ln(f"{p}.self_attn_layer_norm", x)
        h = ln(f"{p}.final_layer_norm", x) if pre_norm else x
        x = x + lin(f"{p}.fc2", np.maximum(lin(f"{p}.fc1", h), 0))
        if not pre_norm:
            x = ln(f"{p}.final_layer_norm", x)
    if pre_norm:
        x = ln("decoder.final_layer_norm", x)
    if "decoder.project_out.weight" in w:
        x = lin("decoder.project_out", x, bias=False)
    head = w["decoder.embed_tokens.weight"] if lm_head is None else lm_head
    return x @ head.T


OPT_CASES = {
    "pre-norm (125m)": opt_config(),
    "post-norm (350m: project_in/out)": opt_config(
        do_layer_norm_before=False, word_embed_proj_dim=32
    ),
    "pre-norm, project_in/out": opt_config(word_embed_proj_dim=32, num_hidden_layers=3),
}


@pytest.mark.parametrize("hf_prefix", [False, True], ids=["decoder.*", "model.decoder.*"])
@pytest.mark.parametrize("name", list(OPT_CASES))
def test_opt_matches_reference(name: str, hf_prefix: bool, tmp_path: Path) -> None:
    config = OPT_CASES[name]
    weights = random_opt_weights(config, seed=len(name))
    stored = {("model." + k if hf_prefix else k): mx.array(v) for k, v in weights.items()}
    model = load_checkpoint(save_checkpoint(tmp_path, config, stored))
    assert model.max_position_embeddings == 64 and model.num_kv_heads == 4

    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(0, config["vocab_size"], n).tolist() for n in (7, 14, 7))
    runner = BlockPoolRunner(model, num_blocks=32, block_size=4)
    runner.step([("B", b[:9]), ("C", c[:6])])
    got = runner.step([("A", a), ("B", b[9:]), ("C", c[6:])], all_logits=True, pad_to=16)
    want = {"A": a, "B": b, "C": c}
    for rid, tokens in want.items():
        ref = reference_logits(weights, config, tokens)[-len(got[rid]) :]
        np.testing.assert_allclose(got[rid], ref, atol=TOL, rtol=TOL, err_msg=rid)


def test_opt_untied_lm_head_is_used(tmp_path: Path) -> None:
    config = opt_config(tie_word_embeddings=False)
    weights = random_opt_weights(config, seed=9)
    head = np.random.default_rng(4).normal(0, 0.3, (300, 64)).astype(np.float32)
    stored = {k: mx.array(v) for k, v in {**weights, "lm_head.weight": head}.items()}
    model = load_checkpoint(save_checkpoint(tmp_path, config, stored))
    tokens = [5, 17, 250, 3]
    got = BlockPoolRunner(model).step([("r", tokens)], all_logits=True)["r"]
    np.testing.assert_allclose(
        got, reference_logits(weights, config, tokens, lm_head=head), atol=TOL, rtol=TOL
    )
    assert np.abs(got - reference_logits(weights, config, tokens)).max() > 1e-2  # not tied
