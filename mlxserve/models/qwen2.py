"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (not on o_proj)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.models import llama
from mlxserve.models.base import context_limit


@dataclass
class ModelArgs(llama.ModelArgs):
    """Qwen2 config.json keys (HF names)."""

    use_sliding_window: bool = False

    @property
    def qkv_bias(self) -> bool:
        return True

    @property
    def o_bias(self) -> bool:
        return False

    @property
    def context_len(self) -> int | None:
        window = self.sliding_window if self.use_sliding_window else None
        return context_limit(self.max_position_embeddings, window)


class Model(llama.Model):
    """Qwen2 causal LM (same parameter names as Llama)."""
