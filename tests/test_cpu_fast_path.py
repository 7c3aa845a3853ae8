"""The CPU fast path (OpenBLAS + dequantized float32 layers) must not change results."""

from __future__ import annotations

import mlx.nn as nn

from mlxserve.loader import load_model
from tests.model_helpers import BlockPoolRunner, greedy_generate


def test_dequantized_model_gives_the_quantized_models_greedy_tokens(llamacpp_oracle) -> None:
    prompts = {c["prompt"]: c["prompt_ids"] for c in llamacpp_oracle["greedy"]}
    outputs = {}
    for dequantize in (False, True):
        model = load_model(skip_tokenizer_init=True, cpu_dequantize=dequantize).model
        up = model.model.layers[0].mlp.up_proj
        assert isinstance(up, nn.QuantizedLinear) != dequantize
        runner = BlockPoolRunner(model, num_blocks=64, block_size=16)
        outputs[dequantize], _ = greedy_generate(runner, prompts, 12)
    assert outputs[True] == outputs[False]
