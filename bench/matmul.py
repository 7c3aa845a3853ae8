"""MLX's CPU matmuls under each BLAS / kernel setting: GFLOP/s per shape, one table.

    PYTHONPATH=. python bench/matmul.py [--settings stock,system,pypi,pypi-nogemv,...]

Each setting runs in a fresh process (the BLAS is bound when mlxserve is imported).
Shapes are SmolLM2-135M's (hidden 576, MLP 1536, vocabulary 49152) at decode (M = 1),
batch (M = 32) and prefill (M = 512) sizes; y = x @ W.T with W stored (out, in), as in
nn.Linear. Settings:

    stock         MLX's bundled BLAS (MLXSERVE_BLAS=off), float32 weights
    system        the system OpenBLAS (MLXSERVE_BLAS=/usr/lib/...), float32 weights
    pypi          scipy-openblas32 from PyPI, the gemv shim on (the default)
    pypi-nogemv   scipy-openblas32, plain sgemm for every shape
    mlx-q4        MLX's own quantized_matmul, 4-bit group 32, float32 scales
    q4 / q8       mlxserve's CPU kernels (mlxserve.cpu), 4-/8-bit group 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 576, 1536), (1, 1536, 576), (1, 576, 49152), (32, 576, 1536), (512, 576, 1536)]
SETTINGS = {
    "stock": {"MLXSERVE_BLAS": "off"},
    "system": {"MLXSERVE_BLAS": "system"},
    "pypi": {"MLXSERVE_BLAS": "pypi"},
    "pypi-nogemv": {"MLXSERVE_BLAS": "pypi", "MLXSERVE_BLAS_GEMV": "off"},
    "mlx-q4": {"MLXSERVE_BLAS": "pypi", "BENCH_KIND": "mlx-q4"},
    "q4": {"MLXSERVE_BLAS": "pypi", "BENCH_KIND": "q4"},
    "q8": {"MLXSERVE_BLAS": "pypi", "BENCH_KIND": "q8"},
}


def measure(kind: str, seconds: float) -> dict[str, object]:
    """GFLOP/s of each shape in this process (the BLAS already chosen by the env)."""
    import mlx.core as mx

    from mlxserve.cpu import blas

    out: dict[str, object] = {"blas": blas.blas_status()}
    mx.random.seed(0)
    for m, k, n in SHAPES:
        x = mx.random.normal((m, k))
        w = mx.random.normal((n, k)) * 0.05
        if kind == "float":
            mx.eval(x, w)

            def run(x=x, w=w):
                return x @ w.T

        else:
            bits = 8 if kind == "q8" else 4
            wq, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            mx.eval(x, wq, scales, biases)
            if kind == "mlx-q4":

                def run(x=x, wq=wq, s=scales, b=biases, bits=bits):
                    return mx.quantized_matmul(x, wq, s, b, True, 32, bits)

            else:
                from mlxserve.cpu import kernels as cpu

                if not cpu.available():
                    return {"error": cpu.status()}

                def run(x=x, wq=wq, s=scales, b=biases, bits=bits):
                    return cpu.quantized_matmul(x, wq, s, b, 32, bits)

        for _ in range(2):
            mx.eval(run())
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            mx.eval(run())
            count += 1
        dt = (time.perf_counter() - start) / count
        out[f"{m}x{k}x{n}"] = {"gflops": 2 * m * k * n / dt / 1e9, "ms": dt * 1e3}
    return out


def child(setting: str, seconds: float) -> dict[str, object]:
    env = dict(os.environ, **SETTINGS[setting])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    choice = env["MLXSERVE_BLAS"]
    if choice in ("system", "pypi"):
        from mlxserve.cpu import blas

        path = blas.system_openblas() if choice == "system" else blas.pypi_openblas()
        if path is None:
            return {"error": f"no {choice} OpenBLAS"}
        env["MLXSERVE_BLAS"] = path
    kind = env.pop("BENCH_KIND", "float")
    code = (
        "import json, sys, mlxserve; from bench.matmul import measure; "
        f"print(json.dumps(measure({kind!r}, {seconds})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds per shape")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    results = {}
    for setting in args.settings.split(","):
        results[setting] = res = child(setting, args.seconds)
        if "error" in res:
            print(f"{setting:12s} error: {res['error']}")
            continue
        cells = [f"{res[f'{m}x{k}x{n}']['gflops']:7.1f}" for m, k, n in SHAPES]
        print(f"{setting:12s} " + " ".join(cells))
    print("GFLOP/s columns (M x K x N): " + ", ".join(f"{m}x{k}x{n}" for m, k, n in SHAPES))
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
