"""Acceptance on the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

``load_model()`` with no MODEL must give the model mlx-lm runs on the same weights: the
GGUF's quantized tensors (un-permuted, as the loader hands them to the model) and its
quantization config are saved as an MLX checkpoint and loaded by mlx-lm's own loader into
mlx-lm's llama (its own attention and KV cache). Greedy decoding must agree token for token.
Prompts are llama.cpp's token ids from the fixture, so no tokenizer is needed.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxserve.loader import cast_weights, load_model
from mlxserve.loader.gguf import load_gguf
from tests.model_helpers import BlockPoolRunner, greedy_generate, mlx_lm_greedy, save_checkpoint

NUM_TOKENS = 20
PROMPTS = ("The capital of France is", "def fibonacci(n):")


def test_default_model_greedy_matches_mlx_lm(
    smollm2_gguf: Path, llamacpp_oracle: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    # Float activations, as mlx-lm's matmuls: int8 ones (the CPU default) round x first and
    # move near ties (tests/test_cpu_int8.py holds them to llama.cpp's steps instead).
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "off")
    loaded = load_model(skip_tokenizer_init=True, cpu_dequantize=False)
    assert loaded.source.path == smollm2_gguf and loaded.dtype == mx.float32
    assert isinstance(loaded.model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    cases = {c["prompt"]: c["prompt_ids"] for c in llamacpp_oracle["greedy"]}
    prompts = {name: cases[name] for name in PROMPTS}
    runner = BlockPoolRunner(loaded.model, num_blocks=8, block_size=16)
    ours, _ = greedy_generate(runner, prompts, NUM_TOKENS)

    config, weights, _ = load_gguf(smollm2_gguf)
    save_checkpoint(tmp_path, config, cast_weights(weights, mx.float32))
    oracle, _ = mlx_lm_load_model(tmp_path)
    assert isinstance(oracle.model.embed_tokens, nn.QuantizedEmbedding)
    for name, prompt in prompts.items():
        want, _ = mlx_lm_greedy(oracle, prompt, NUM_TOKENS)
        assert ours[name] == want, name
    # llama.cpp (an independent engine and quantized kernels) starts the same way.
    steps = {c["prompt"]: [s["id"] for s in c["steps"]] for c in llamacpp_oracle["greedy"]}
    assert ours["The capital of France is"][:2] == steps["The capital of France is"][:2]


def test_default_model_answers_a_chat_question(llamacpp_oracle: dict) -> None:
    """load_model() + the GGUF's tokenizer and chat template: a real answer, greedily."""
    loaded = load_model()
    tok = loaded.tokenizer
    # The tokenizer built from the loader's metadata reader is llama.cpp's tokenizer.
    for case in llamacpp_oracle["tokenize"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
    chat = llamacpp_oracle["chat_template"][0]
    assert tok.apply_chat_template(chat["messages"]) == chat["prompt"]

    messages = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    prompt = tok.encode_chat(messages)
    runner = BlockPoolRunner(loaded.model, num_blocks=8, block_size=16)
    out, _ = greedy_generate(runner, {"r": prompt}, 8)
    answer = tok.decode(out["r"])
    assert "Paris" in answer, answer
