"""How a model's hidden states become an embedding: what its files say.

sentence-transformers checkpoints carry ``modules.json`` and a ``*_Pooling/config.json``
with ``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` (Qwen3-Embedding, gte-Qwen2,
e5-mistral...); GGUF files carry ``{arch}.pooling_type`` (llama.cpp: 1 mean, 3 last).
Anything else is a causal LM: its last token's hidden state is the one that has seen the
whole prompt, so "last" is the default (as vLLM's for decoder models).
"""

from __future__ import annotations

import json
from pathlib import Path

GGUF_POOLING_TYPES = {1: "mean", 3: "last"}


def read_pooling_method(model_dir: Path) -> str:
    """ "last" or "mean" for a model directory; ValueError for a mode mlxserve cannot pool."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return "last"
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config_file = model_dir / module.get("path", "") / "config.json"
            if not config_file.is_file():
                return "last"
            return _method(json.loads(config_file.read_text(encoding="utf-8")), config_file)
    return "last"


def _method(config: dict, where: Path) -> str:
    if config.get("pooling_mode_lasttoken"):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
    raise ValueError(
        f"{where}: pooling {', '.join(modes) or 'none'} is not supported; mlxserve pools "
        "the last token (pooling_mode_lasttoken) or the mean (pooling_mode_mean_tokens)"
    )


def gguf_pooling_method(metadata: dict, arch: str) -> str:
    """ "last" or "mean" from a GGUF's ``{arch}.pooling_type`` (absent: last)."""
    value = metadata.get(f"{arch}.pooling_type")
    if value is None or int(value) == 0:
        return "last"
    if int(value) not in GGUF_POOLING_TYPES:
        raise ValueError(
            f"{arch}.pooling_type {value} is not supported; mlxserve pools the last token (3) "
            "or the mean (1)"
        )
    return GGUF_POOLING_TYPES[int(value)]
