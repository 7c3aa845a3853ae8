"""The CPU backend's installer (mlxserve/cpu/install.py): which modules get the fused
forwards, which keep their own, and a pipeline stage made after loading.

That the bound forwards give the separate ops' bits is tests/test_cpu_layer.py's and
tests/test_cpu_stack.py's (they run models as the loader installs them).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxserve.cpu import install
from mlxserve.cpu import kernels as cpu
from mlxserve.cpu import ops as cpu_ops
from mlxserve.loader import load_model
from mlxserve.models import llama
from mlxserve.models.pipeline_parallel import PipelineStage
from mlxserve.worker.model_runner import ModelRunner
from tests.model_helpers import make_mlx_lm_checkpoint, tiny_config
from tests.test_cpu_layer import quantized_checkpoints
from tests.test_cpu_stack import _step_inputs

pytestmark = pytest.mark.skipif(not cpu.available(), reason="mlxserve's CPU kernels not built")

CONFIG = tiny_config("llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cpu_install")
    return quantized_checkpoints(root, {"llama": CONFIG}, seed=3)["llama"]


def _names(model: nn.Module) -> list[str]:
    return sorted(name for name, _ in tree_flatten(model.parameters()))


def test_the_loader_binds_the_fused_forwards_and_changes_no_parameter(checkpoint: Path) -> None:
    model = load_model(str(checkpoint), skip_tokenizer_init=True).model
    stack = model.model
    assert isinstance(stack, install.CpuDecoderStack) and isinstance(stack, llama.DecoderStack)
    assert all(isinstance(layer, install.CpuDecoderLayer) for layer in stack.layers)
    assert all(isinstance(layer, llama.DecoderLayer) for layer in stack.layers)
    assert type(stack.layers[0]) is type(stack.layers[1])  # one class per pair, made once
    assert install.bind_forwards(model) == 0  # bound already: nothing changes
    plain = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    nn.quantize(plain, group_size=32, bits=4)
    assert _names(model) == _names(plain)


def test_a_model_off_the_kernels_keeps_the_architecture_s_forwards(tmp_path: Path) -> None:
    _, path = make_mlx_lm_checkpoint(tmp_path / "float", CONFIG, seed=3)  # not quantized
    model = load_model(str(path), skip_tokenizer_init=True).model
    assert install.bind_forwards(model) == 0
    assert type(model.model) is llama.DecoderStack
    assert all(type(layer) is llama.DecoderLayer for layer in model.model.layers)


def test_a_subclass_with_its_own_forward_keeps_it() -> None:
    class OwnLayer(llama.DecoderLayer):
        def __call__(self, x, positions, md, cache):  # an architecture's own layer forward
            return super().__call__(x, positions, md, cache)

    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    model.model.layers[0].__class__ = OwnLayer
    nn.quantize(model, group_size=32, bits=4)
    assert cpu.use_kernels(model) > 0
    assert install.bind_forwards(model) == 2  # the stack and layer 1
    assert type(model.model.layers[0]) is OwnLayer
    assert isinstance(model.model.layers[1], install.CpuDecoderLayer)


def test_a_pipeline_stage_made_after_loading_runs_its_layers_in_one_op(
    checkpoint: Path,
) -> None:
    """The runner binds what was made from the loaded model (one rank: all the layers)."""
    from bench.decode_profile import op_histogram

    loaded = load_model(str(checkpoint), skip_tokenizer_init=True)
    stage = PipelineStage(loaded.model, mx.distributed.init(), 64)
    assert not isinstance(stage, install.CpuLayers)
    ModelRunner(stage, dtype=mx.float32, block_size=4)  # fuses, then binds
    assert isinstance(stage, install.CpuLayers) and isinstance(stage, PipelineStage)
    x, positions, md, cache = _step_inputs(stage, len(stage.layers))
    step = (stage.layers[0].self_attn.rope.tables(positions, mx.float32), cpu_ops.step_rows(md))
    mx.eval(x, cache.arrays(), step)
    h = stage.run_layers(x, positions, md, cache)
    assert op_histogram([h, *cache.arrays()]) == {"MlxserveCpuDecoderStack": 1}
