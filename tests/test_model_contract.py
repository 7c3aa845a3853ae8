"""The model contract (mlxserve/models/contract.py): every model the registry builds is a
Model, and the runner's capability checks tell the kinds of model apart as the engine needs
(per-layer cache kinds only for the mlx-lm adapter, a process group only when split)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxserve.models import contract
from mlxserve.worker.model_runner import ModelRunner
from tests.model_helpers import load_checkpoint, make_mlx_lm_checkpoint, tiny_config
from tests.zoo_configs import ZOO


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_hand_written_model_has_uniform_layers(tmp_path: Path, model_type: str) -> None:
    _, path = make_mlx_lm_checkpoint(tmp_path, tiny_config(model_type, head_dim=16))
    model = load_checkpoint(path, mx.float32)
    assert isinstance(model, contract.UniformModel)
    assert not isinstance(model, contract.LayoutModel)
    assert not isinstance(model, contract.PipelineStageModel | contract.ShardedModel)
    runner = ModelRunner(model, dtype=mx.float32, block_size=4)
    assert list(runner.layout.tensor_shapes) == [(2, 16, 16)] * 2  # layers x (kv heads, K, V)
    assert runner.group is None


def test_an_adapted_mlx_lm_model_gives_its_own_layout(tmp_path: Path) -> None:
    """gpt-oss alternates sliding-window and full-attention layers: its layout says so."""
    _, path = make_mlx_lm_checkpoint(tmp_path, ZOO["gpt_oss"])
    model = load_checkpoint(path, mx.float32)
    assert isinstance(model, contract.Model)
    assert isinstance(model, contract.LayoutModel)
    assert not isinstance(model, contract.UniformModel)  # its layers' pools differ
    runner = ModelRunner(model, dtype=mx.float32, block_size=4)
    assert runner.layout == model.kv_cache_layout
    assert len({spec.kind for spec in runner.layout.specs}) == 2  # sliding window + full
    assert runner.group is None
