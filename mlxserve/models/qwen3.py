"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.models import llama
from mlxserve.models.base import context_limit


@dataclass
class ModelArgs(llama.ModelArgs):
    """Qwen3 config.json keys (HF names); head_dim is explicit (HF default 128)."""

    head_dim: int | None = 128
    use_sliding_window: bool = False

    @property
    def use_qk_norm(self) -> bool:
        return True

    @property
    def context_len(self) -> int | None:
        window = self.sliding_window if self.use_sliding_window else None
        return context_limit(self.max_position_embeddings, window)


class Model(llama.Model):
    """Qwen3 causal LM: adds ``self_attn.q_norm`` / ``self_attn.k_norm`` (RMSNorm over head_dim)."""
