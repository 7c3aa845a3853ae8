"""What a front-end may know about the served model: ModelInfo, from ``describe()``.

The server reads the model through this record only (its limits, its size, the facts
Ollama's /api/show reports, the tokenizer it renders prompts with), never the engine's
loaded model, runner or config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """The served model, as the engine describes it to the server."""

    name: str  # the engine's model name (the served name or the source's name)
    max_model_len: int  # prompt + output tokens one request may hold
    vocab_size: int  # token ids are in [0, vocab_size)
    weight_bytes: int  # the weights' size in memory
    architecture: str  # the HF config's model_type ("" when it has none)
    file_format: str  # "gguf" | "safetensors"
    # The config's scalar entries (str, int, float), for listings such as /api/show.
    config_facts: dict[str, Any] = field(default_factory=dict, compare=False)
    # The tokenizer and its chat templates (None with skip_tokenizer_init).
    tokenizer: Any = field(default=None, compare=False, repr=False)


def config_facts(config: dict[str, Any]) -> dict[str, Any]:
    """The scalar entries of a HF-style config (nested and list values left out)."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float, str))}
