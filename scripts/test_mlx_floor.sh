#!/usr/bin/env bash
# CI, after scripts/test.sh: the same environment with MLX downgraded to the floor that
# pyproject.toml declares, then the tests whose outcome depends on MLX's version (the rest
# of the suite tests mlxserve's own code, the same on any MLX). Changes the active
# environment's MLX: run it only in a throwaway venv (.ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(python - <<'PY'
import re
text = open("pyproject.toml").read()
print(re.search(r'"mlx\[cpu\]>=([0-9.]+)', text).group(1))
PY
)
extra=$([ "$(uname)" = Darwin ] && echo "" || echo "[cpu]")
if [ -z "$extra" ]; then
    python -m pip install --quiet "mlx==${floor}"
else  # only the two MLX wheels change: --no-deps skips re-resolving (10 s -> 7 s)
    python -m pip install --quiet --no-deps "mlx==${floor}" "mlx-cpu==${floor}"
fi
python -c "import mlx.core as mx; print('MLX floor', mx.__version__)"
# Why each is here (what a different MLX changes under it):
#   test_mlx_floor.py        the installed MLX is inside the declared range
#   test_metal_dispatch.py   mx.export_function records the custom kernels; a kernel name
#                            means one source (MLX before 0.32 keyed kernels by name, #3662)
#   test_metal_selftest.py   the kernels' run-time self-test against the fallback (MLX ops)
#   test_metal_kernels.py    the fallback (MLX ops) against the kernels on every dtype, path,
#                            window/sinks and the int8 pool, and the in-place pool write
#                            (MLX's scatter into a donated buffer). The shape sweep and the
#                            extended shapes on the emulator vary the kernels, not MLX (the
#                            main run has them); on a Mac they run for real on the floor MLX
#   test_paged_attention.py  the fallback, made of MLX ops, against a dense numpy attention
#   test_loader_gguf.py      mx.load's GGUF reader (Q4_1 read wrongly before 0.32.0, #3664)
#                            and MLX's (de)quantize; the header test reads no MLX: skipped
#   test_models_smollm2.py   the embedded model (Q4_1 GGUF through MLX's quantized layers)
#                            against llama.cpp's greedy steps: the end-to-end check
#   test_cpu_kernels.py      mlxserve's C kernels built against this MLX's headers and
#                            bindings (MLX before 0.32.3 binds with nanobind 2, which the
#                            kernels' nanobind 3 cannot pass an mx.array: the floor's reason)
# Two workers, as scripts/test.sh (MLXSERVE_TEST_WORKERS=0: in this process).
python -m pytest -q -n "${MLXSERVE_TEST_WORKERS:-2}" --dist loadgroup \
    tests/test_mlx_floor.py tests/test_metal_dispatch.py tests/test_metal_selftest.py \
    tests/test_metal_kernels.py tests/test_paged_attention.py tests/test_loader_gguf.py \
    tests/test_models_smollm2.py tests/test_cpu_kernels.py \
    -k "not (emulator and (test_kernels_match_fallback or test_extended_shapes_match_fallback)) \
        and not test_header_reader_agrees_with_gguf_package" "$@"
