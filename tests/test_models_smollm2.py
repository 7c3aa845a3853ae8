"""The llama architecture on real weights: the embedded SmolLM2 GGUF against llama.cpp.

Teacher-forced: each request's prompt plus llama.cpp's 16 greedy tokens run as one batch
through the block pool; at every step our argmax must be llama.cpp's token where its top-2
gap is clear, and llama.cpp's token must be in our top 3 everywhere (llama.cpp rounds
activations to 8 bits inside quantized matmuls, so near-ties may flip).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxserve.loader import cast_weights
from mlxserve.loader.gguf import load_gguf
from mlxserve.models import build_model
from tests.model_helpers import BlockPoolRunner
from tests.paths import check_llamacpp_step

PROMPTS = ("The capital of France is", "Once upon a time")


def test_smollm2_gguf_matches_llamacpp(smollm2_gguf: Path, llamacpp_oracle: dict) -> None:
    config, weights, _ = load_gguf(smollm2_gguf)
    model = build_model(config, cast_weights(weights, mx.float32))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    cases = [c for c in llamacpp_oracle["greedy"] if c["prompt"] in PROMPTS]
    assert len(cases) == len(PROMPTS)

    work = []
    for i, case in enumerate(cases):
        sequence = case["prompt_ids"] + [s["id"] for s in case["steps"]]
        work.append((f"r{i}", sequence[:-1]))
    logits = BlockPoolRunner(model, num_blocks=8, block_size=16).step(work, all_logits=True)

    num_clear = 0
    for i, case in enumerate(cases):
        rows = logits[f"r{i}"][len(case["prompt_ids"]) - 1 :]  # (16, vocab)
        for step, row in zip(case["steps"], rows, strict=True):
            num_clear += check_llamacpp_step(step, row, case["prompt"])
    assert num_clear >= 20  # most steps are clear: the check has teeth
