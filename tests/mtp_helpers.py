"""Tiny random glm4_moe / mimo checkpoints with an MTP layer, and a dense MTP oracle.

The checkpoints are the zoo's tiny configs (tests/zoo_configs.py) with the tokenizer of
tests/engine_helpers.py, plus the MTP layer's tensors under the HF names the real
checkpoints use (GLM: ``model.layers.{N}.*``, experts unstacked; MiMo:
``model.mtp_layers.0.*``). The oracle computes an MTP layer as the HF/vLLM modeling code
does, in plain MLX ops over one dense sequence (no pool, no paging): the target's last
hidden states from mlx-lm's own layers, embedding (zero at position 0), the two norms,
the concatenation in the architecture's order, the projection, the decoder block under a
causal mask (mlx-lm's module, its own attention path), the head.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from tests.engine_helpers import VOCAB_SIZE, write_tokenizer
from tests.model_helpers import make_mlx_lm_checkpoint
from tests.zoo_configs import ZOO

MTP_TYPES = ("glm4_moe", "mimo")


def mtp_config(model_type: str) -> dict:
    return ZOO[model_type] | {
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
    }


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    x32 = x.astype(mx.float32)
    return x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w


def make_mtp_model_dir(path: Path, model_type: str, seed: int = 0) -> tuple[nn.Module, Path, dict]:
    """(mlx-lm target oracle, model dir, the MTP tensors by HF name)."""
    config = mtp_config(model_type)
    oracle, model_dir = make_mlx_lm_checkpoint(path, config, seed=seed)
    write_tokenizer(model_dir)
    module = importlib.import_module(type(oracle).__module__)
    n = config["num_hidden_layers"]
    mx.random.seed(seed + 1)
    if model_type == "glm4_moe":
        block, prefix = module.DecoderLayer(oracle.args, n), f"model.layers.{n}."
    else:
        block, prefix = module.TransformerBlock(oracle.args), "model.mtp_layers.0."
    hidden = config["hidden_size"]
    keys = iter(mx.random.split(mx.random.key(seed + 2), 64))
    weights: dict[str, mx.array] = {}
    for name, w in tree_flatten(block.parameters()):
        if "norm" in name and name.endswith("weight"):
            w = 1.0 + 0.2 * mx.random.normal(w.shape, key=next(keys))
        elif name.endswith("bias") or not mx.any(w).item():  # zero-initialised: the router
            w = 0.2 * mx.random.normal(w.shape, key=next(keys))
        if ".switch_mlp." in name:  # HF: one tensor per expert
            part = name.replace("mlp.switch_mlp.", "")
            for e in range(w.shape[0]):
                weights[f"{prefix}mlp.experts.{e}.{part}"] = w[e]
            continue
        weights[prefix + name] = w
    if model_type == "glm4_moe":
        names = {"enorm": "enorm", "hnorm": "hnorm", "shared_head.norm": "out"}
    else:
        names = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "final_layernorm": "out"}
    for name in names:
        weights[f"{prefix}{name}.weight"] = 1.0 + 0.2 * mx.random.normal((hidden,), key=next(keys))
    proj = "eh_proj" if model_type == "glm4_moe" else "input_proj"
    scale = (2 * hidden) ** -0.5
    weights[f"{prefix}{proj}.weight"] = scale * mx.random.normal(
        (hidden, 2 * hidden), key=next(keys)
    )
    if model_type == "glm4_moe":  # GLM ships its own copies of the embedding and head
        target = mx.load(str(model_dir / "model.safetensors"))
        weights[f"{prefix}embed_tokens.weight"] = target["model.embed_tokens.weight"]
        weights[f"{prefix}shared_head.head.weight"] = 1.5 * target["lm_head.weight"]
    mx.eval(weights)
    all_weights = dict(mx.load(str(model_dir / "model.safetensors"))) | weights
    mx.save_safetensors(str(model_dir / "model.safetensors"), all_weights, {"format": "mlx"})
    return oracle, model_dir, weights


class DenseMtp:
    """The oracle: the target's hidden states and its MTP layer over one dense sequence."""

    def __init__(self, oracle: nn.Module, model_type: str, weights: dict[str, mx.array]) -> None:
        self.oracle = oracle
        self.model_type = model_type
        self.eps = oracle.args.rms_norm_eps
        module = importlib.import_module(type(oracle).__module__)
        n = oracle.args.num_hidden_layers
        if model_type == "glm4_moe":
            prefix, self.block = f"model.layers.{n}.", module.DecoderLayer(oracle.args, n)
        else:
            prefix, self.block = "model.mtp_layers.0.", module.TransformerBlock(oracle.args)
        w = {k[len(prefix) :]: v for k, v in weights.items()}
        block = {k: v for k, v in w.items() if k.split(".")[0] in ("self_attn", "mlp")}
        block |= {k: v for k, v in w.items() if k.startswith(("input_layernorm", "post_attention"))}
        experts = sorted({k for k in block if ".experts." in k})
        for part in ("gate_proj", "up_proj", "down_proj"):
            parts = [k for k in experts if f".{part}." in k]
            if parts:
                count = len(parts)
                block[f"mlp.switch_mlp.{part}.weight"] = mx.stack(
                    [block.pop(f"mlp.experts.{e}.{part}.weight") for e in range(count)]
                )
        self.block.load_weights(list(block.items()), strict=True)
        self.w = w

    def target_hidden(self, tokens: list[int]) -> mx.array:  # (L, hidden), before the norm
        inner = self.oracle.model
        h = inner.embed_tokens(mx.array([tokens]))
        for layer in inner.layers:
            h = layer(h, "causal", None)
        return h[0]

    def run(self, next_tokens: list[int], hidden: mx.array) -> mx.array:  # (L, hidden): g
        """The MTP layer at positions 0..L-1: row i gets the token after position i and
        the hidden state of position i."""
        glm = self.model_type == "glm4_moe"
        w = self.w
        embed = w["embed_tokens.weight"] if glm else self.oracle.model.embed_tokens.weight
        e = embed[mx.array(next_tokens)]
        e = mx.concatenate([mx.zeros_like(e[:1]), e[1:]])  # position 0: no embedding
        if glm:
            e = _rms(e, w["enorm.weight"], self.eps)
            h = _rms(hidden, w["hnorm.weight"], self.eps)
            x = mx.concatenate([e, h], axis=-1) @ w["eh_proj.weight"].T
        else:
            e = _rms(e, w["token_layernorm.weight"], self.eps)
            h = _rms(hidden, w["hidden_layernorm.weight"], self.eps)
            x = mx.concatenate([h, e], axis=-1) @ w["input_proj.weight"].T
        g = self.block(x[None], "causal", None)[0]
        return g if glm else _rms(g, w["final_layernorm.weight"], self.eps)

    def logits(self, g: mx.array) -> mx.array:
        if self.model_type == "glm4_moe":
            w = self.w
            return _rms(g, w["shared_head.norm.weight"], self.eps) @ w["shared_head.head.weight"].T
        return self.oracle.lm_head(g)

    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """Greedy drafts after ``tokens`` (its last token not yet computed by the target),
        as the engine drafts them: the MTP layer over positions 0..L-2 with the target's
        hidden states, then fed its own g and draft. Also each draft's top-2 margin."""
        hidden = self.target_hidden(tokens[:-1])
        nxt = list(tokens[1:])
        out, margins = [], []
        for _ in range(k):
            g = self.run(nxt, hidden)
            logits = np.array(self.logits(g[-1:])[0].astype(mx.float32))
            top = np.sort(logits)[-2:]
            out.append(int(np.argmax(logits)))
            margins.append(float(top[1] - top[0]))
            nxt.append(out[-1])
            hidden = mx.concatenate([hidden, g[-1:]])
        return out, margins
