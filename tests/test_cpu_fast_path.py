"""The CPU fast path (OpenBLAS + dequantized float32 layers) must not change results."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.nn as nn

from mlxserve.loader import load_model
from tests.model_helpers import BlockPoolRunner, greedy_generate
from tests.paths import ROOT


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


def blas_choice(setting: str) -> list[str]:
    """(fast_blas(), blas_status()) in a fresh interpreter with MLXSERVE_BLAS=setting."""
    code = "import mlxserve.blas as b, mlxserve; print(b.fast_blas()); print(b.blas_status())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, MLXSERVE_BLAS=setting),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_blas_can_be_turned_off_and_says_why() -> None:
    assert blas_choice("off") == ["None", "MLXSERVE_BLAS=off"]
    path, why = blas_choice("/nonexistent/libopenblas.so.0")
    assert path == "None" and why.startswith("could not load /nonexistent/")
