"""A Mistral-7B-v0.1-style model for tests: mlx-lm's llama with a sliding window in every
layer. mlx-lm's own llama cannot be configured so (it looks up a full-attention layer to
build its causal mask), so this module sets its layers' window after building it; the
attention, masks and RotatingKVCaches are mlx-lm's. Registered as ``mlx_lm.models.swa_llama``
by the tests that use it."""

from __future__ import annotations

from mlx_lm.models import llama
from mlx_lm.models.llama import ModelArgs

__all__ = ["Model", "ModelArgs"]


class Model(llama.Model):
    """mlx-lm's llama, every layer windowed (``sliding_window`` tokens)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        for layer in self.layers:
            layer.use_sliding = True
        self.model.layer_types = ["sliding_attention"] * len(self.layers)
        self.model.swa_idx = 0  # the mask both layer kinds would use: the window's
        self.model.fa_idx = 0
