"""The CPU fast path (OpenBLAS + dequantized float32 layers) must not change results.

Against the kernels with float activations (MLXSERVE_CPU_INT8=off): int8 ones round x
first, so they move near ties by design (tests/test_cpu_int8.py tracks llama.cpp instead).
"""

from __future__ import annotations

import mlx.nn as nn
import pytest

from mlxserve.loader import load_model
from tests.model_helpers import BlockPoolRunner, greedy_generate


def test_dequantized_model_gives_the_quantized_models_greedy_tokens(
    llamacpp_oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "off")
    prompts = {c["prompt"]: c["prompt_ids"] for c in llamacpp_oracle["greedy"]}
    outputs = {}
    for dequantize in (False, True):
        model = load_model(skip_tokenizer_init=True, cpu_dequantize=dequantize).model
        up = model.model.layers[0].mlp.up_proj
        assert isinstance(up, nn.QuantizedLinear) != dequantize
        runner = BlockPoolRunner(model, num_blocks=64, block_size=16)
        outputs[dequantize], _ = greedy_generate(runner, prompts, 12)
    assert outputs[True] == outputs[False]
