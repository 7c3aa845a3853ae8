#!/usr/bin/env bash
# CI, after scripts/test.sh: the same environment with MLX downgraded to the floor that
# pyproject.toml declares, then the tests that depend most on MLX's version (kernels,
# dispatch, GGUF loading, the embedded model). Changes the active environment's MLX: run it
# only in a throwaway venv (.ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(python - <<'PY'
import re
text = open("pyproject.toml").read()
print(re.search(r'"mlx\[cpu\]>=([0-9.]+)', text).group(1))
PY
)
extra=$([ "$(uname)" = Darwin ] && echo "" || echo "[cpu]")
python -m pip install --quiet "mlx${extra}==${floor}"
python -c "import mlx.core as mx; print('MLX floor', mx.__version__)"
# Two workers, as scripts/test.sh (MLXSERVE_TEST_WORKERS=0: in this process).
python -m pytest -q -n "${MLXSERVE_TEST_WORKERS:-2}" --dist loadgroup \
    tests/test_metal_selftest.py tests/test_metal_dispatch.py tests/test_metal_kernels.py \
    tests/test_paged_attention.py tests/test_loader_gguf.py tests/test_engine_smollm2.py "$@"
