"""llama.cpp, built on demand from the llama-cpp-python source package (PyPI).

The source package vendors the whole llama.cpp tree; it is downloaded with pip (the
ordinary client, no other network access) and built with cmake into a cache folder:

    ~/.cache/mlxserve-bench/llama-cpp/<version>/bin-<BUILD>/{llama-server,llama-bench,...}

The build is native (-march=native) without Intel AMX: ggml's AMX kernels for Q4_1 die
with SIGILL on their first `tilezero` on a 2-core Xeon VM that advertises AMX
(llama-cpp-python 0.3.36), so llama-server could not answer a prompt there.

Never in CI or tests: a build takes ~10 minutes on 2 cores. The tools read the GGUF directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from mlxserve.cli.bench.common import cache_dir

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is what gets built
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize")
BUILD = "native-noamx"  # names the build options below (a different build, a new folder)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # ggml builds AMX code only if enabled


def cache_root() -> Path:
    return cache_dir() / "llama-cpp"


def bin_dir(version: str = VERSION) -> Path:
    return cache_root() / version / f"bin-{BUILD}"


def ensure_built(version: str = VERSION, log=print) -> Path:
    """The bin folder holding TARGETS, downloading and building them if missing."""
    out = bin_dir(version)
    if all((out / t).exists() for t in TARGETS):
        return out
    for tool in ("cmake",):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} (apt install cmake g++)")
    root = cache_root() / version
    src = root / "src"
    sdist = src / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        log(f"[llama.cpp] downloading llama-cpp-python=={version} (source) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run(cmd + [f"llama-cpp-python=={version}", "-d", str(src)], check=True)
    tree = src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not tree.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    build = root / f"build-{BUILD}"
    log(f"[llama.cpp] building {', '.join(TARGETS)} in {build} (several minutes)")
    configure = [
        "cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF",
    ]  # fmt: skip
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    cmd = ["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    out.mkdir(parents=True, exist_ok=True)
    for t in TARGETS:
        shutil.copy2(build / "bin" / t, out / t)
    info = {"version": version, "build": BUILD, "targets": TARGETS}
    (root / f"build-info-{BUILD}.json").write_text(json.dumps(info))
    return out


def offline(gguf: Path, spec, threads: int, log=print) -> dict[str, float]:
    """llama.cpp's own benchmarks: llama-bench (prefill, decode), llama-batched-bench."""
    bins = bin_dir()
    res: dict[str, float] = {}
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-o", "json"]
    cmd += ["-p", str(spec.prefill_tokens), "-n", str(spec.decode_tokens), "-r", "3"]
    log(f"[llama.cpp] {' '.join(cmd)}")
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for row in rows:
        if row["n_prompt"] and not row["n_gen"]:
            res["prefill_tok_s"] = row["avg_ts"]
        elif row["n_gen"] and not row["n_prompt"]:
            res["decode_tok_s"] = row["avg_ts"]
    npl = ",".join(str(n) for n in spec.batch_sizes)
    ctx = max(spec.batch_sizes) * (spec.prompt_tokens + spec.batch_tokens) + 64
    cmd = [str(bins / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads)]
    cmd += ["-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(spec.prompt_tokens)]
    cmd += ["-ntg", str(spec.batch_tokens), "-npl", npl, "--output-format", "jsonl"]
    log(f"[llama.cpp] {' '.join(cmd)}")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            # Same definition as the other engines: output tokens / (prefill + decode) time.
            res[f"batch{row['pl']}_tok_s"] = row["pl"] * row["tg"] / row["t"]
    log(f"[llama.cpp] {json.dumps({k: round(v, 1) for k, v in res.items()})}")
    return res


def server_cmd(gguf: Path, threads: int, parallel: int, ctx_per_slot: int) -> list[str]:
    """llama-server with `parallel` slots (continuous batching is on by default)."""
    return [
        str(bin_dir() / "llama-server"), "-m", str(gguf), "-t", str(threads),
        "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "--host", "127.0.0.1",
        "--no-webui",
    ]  # fmt: skip


if __name__ == "__main__":
    print(ensure_built())
