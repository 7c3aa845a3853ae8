"""Compile the CPU kernels' MLX extension on first use, cache it, load it.

The extension (csrc/qmm_ext.cpp + the kernels) links against the libmlx of the installed
mlx wheel, through MLX's own headers (the wheel ships them) and nanobind (a dependency;
the module joins mlx.core's nanobind domain so mx.array passes through). It is built with
the system C/C++ compilers into $XDG_CACHE_HOME/mlxserve/cpu (else ~/.cache/...), once
per combination of sources, mlx, nanobind and Python; later imports only load it.
Anything missing (no compiler, no Python headers) raises BuildError saying what.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from mlxserve.cpu.blas import user_cache_dir

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ["qmm.c", "qmm_scalar.c", "qmm_avx2.c", "qmm_avx512.c", "qmm_neon.c"]
SOURCES += ["q8_scalar.c", "q8_avx2.c", "q8_avxvnni.c", "q8_avx512vnni.c", "q8_neon.c"]
SOURCES += ["q8_quantize.c", "swiglu.c"]
HEADERS = ["qmm.h", "qmm_common.h", "qmm_impl.h", "q8_impl.h", "q8_x86.h", "decode_ext.h"]
HEADERS += ["linear.h", "layer_parts.h", "attn_keys.h"]
# C++ against MLX's headers: the primitives (qmm_ext.cpp defines the module). The RoPE,
# RMSNorm and fused layer primitives round as MLX's ops do (bit for bit): no fused
# multiply-adds there.
EXT_SOURCES = ["qmm_ext.cpp", "attn_ext.cpp", "rope_norm_ext.cpp", "layer_ext.cpp"]
EXT_SOURCES += ["linear_ext.cpp", "decoder_layer_ext.cpp", "decoder_stack_ext.cpp"]
EXT_FLAGS = {
    "attn_ext.cpp": ["-O3", "-ffp-contract=off"],  # the same bits on every instruction set
    "rope_norm_ext.cpp": ["-ffp-contract=off"],
    "layer_ext.cpp": ["-O3", "-ffp-contract=off"],  # the same bits as the separate ops
    "linear_ext.cpp": ["-O3", "-ffp-contract=off"],
    "decoder_layer_ext.cpp": ["-O3", "-ffp-contract=off"],
    "decoder_stack_ext.cpp": ["-O3", "-ffp-contract=off"],
}
# Per-file flags: each instruction set in its own file, chosen at run time (qmm.c).
X86_FLAGS = {
    "qmm_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "qmm_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "q8_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "q8_avxvnni.c": ["-mavxvnni", "-mavx2", "-mfma", "-mf16c"],
    "q8_avx512vnni.c": ["-mavx512f", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]
    + ["-mprefer-vector-width=256"],  # 256-bit like the others: no 512-bit frequency drop
}
ARM_FLAGS = {"q8_neon.c": ["-march=armv8.2-a+dotprod"]}
# No fused multiply-add in the int8 path: the activations' rounding (q8_quantize.c) rounds
# x * id before adding, and the matmul's float sums are one fixed sequence of rounded
# operations (q8_impl.h), the same on every instruction set.
COMMON_FLAGS = {n: ["-ffp-contract=off"] for n in SOURCES if n.startswith("q8_")}
COMMON_FLAGS["swiglu.c"] = ["-ffp-contract=off"]  # MLX's sigmoid, operation by operation


class BuildError(RuntimeError):
    """The extension could not be built here; the message says what is missing."""


def cache_dir() -> Path:
    return user_cache_dir() / "cpu"


def _tool(env: str, *names: str) -> str:
    for name in [os.environ.get(env, ""), *names]:
        found = name and shutil.which(name)
        if found:
            return found
    raise BuildError(f"no {env} compiler found (tried {', '.join(names)}; set ${env})")


def _inputs() -> tuple[str, dict[str, str]]:
    """The build's identity (a hash) and the paths it needs."""
    import mlx.core as mx

    try:
        import nanobind
    except ImportError:
        raise BuildError("nanobind is not installed (pip install nanobind)") from None
    mlx_root = Path(mx.__file__).resolve().parent
    paths = {
        "mlx_include": str(mlx_root / "include"),
        "mlx_lib": str(mlx_root / "lib"),
        "nanobind": str(Path(nanobind.include_dir()).parent),
        "python_include": sysconfig.get_paths()["include"],
        "nanobind_version": nanobind.__version__,
    }
    if not (Path(paths["mlx_include"]) / "mlx" / "array.h").exists():
        raise BuildError(f"this mlx wheel ships no C++ headers ({paths['mlx_include']})")
    if not (Path(paths["python_include"]) / "Python.h").exists():
        raise BuildError(
            f"Python headers missing ({paths['python_include']}/Python.h): apt install python3-dev"
        )
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS + EXT_SOURCES:
        digest.update((CSRC / name).read_bytes())
    flags = (X86_FLAGS, ARM_FLAGS, COMMON_FLAGS, EXT_FLAGS)
    digest.update(repr(flags).encode())  # flags change code
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for part in (
        mx.__version__,
        nanobind.__version__,
        suffix,
        platform.machine(),
        paths["mlx_lib"],
    ):
        digest.update(str(part).encode())
    return digest.hexdigest()[:16], paths


def module_name(tag: str) -> str:
    return f"_mlxserve_qmm_{tag}"


def _compilers() -> tuple[str, str]:
    """The C and C++ compilers ($CC / $CXX, else the usual names on PATH)."""
    return _tool("CC", "cc", "gcc", "clang"), _tool("CXX", "c++", "g++", "clang++")


def _compile_all(paths: dict[str, str], name: str, work: Path, out: Path) -> None:
    cc, cxx = _compilers()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    arm = platform.machine().lower() in ("arm64", "aarch64")
    nb = Path(paths["nanobind"])
    jobs: list[list[str]] = []
    objects = []
    for src in SOURCES:
        obj = work / (src + ".o")
        flags = (X86_FLAGS if x86 else ARM_FLAGS if arm else {}).get(src, [])
        flags = flags + COMMON_FLAGS.get(src, [])
        jobs.append(
            [cc, "-O3", "-fPIC", "-std=gnu11", *flags, "-c", str(CSRC / src), "-o", str(obj)]
        )
        objects.append(obj)
    nb_flags = ["-I", str(nb / "include"), "-I", str(nb / "ext" / "robin_map" / "include")]
    nb_flags += ["-I", paths["python_include"], "-fvisibility=hidden", "-fPIC", "-O2", "-std=c++20"]
    # nanobind's runtime takes most of the build and changes only with nanobind, Python
    # and the compiler: it is kept apart in the cache, so a new mlxserve rebuilds in seconds.
    nb_cmd = [cxx, *nb_flags, "-DNB_BUILD", "-DNB_COMPACT_ASSERTIONS", "-fno-strict-aliasing"]
    nb_cmd += ["-c", str(nb / "src" / "nb_combined.cpp")]
    nb_key = hashlib.sha256("\0".join([*nb_cmd, paths["nanobind_version"]]).encode())
    nb_obj = cache_dir() / f"nanobind-{nb_key.hexdigest()[:16]}.o"
    nb_staged = work / "nanobind.o"
    if not nb_obj.exists():
        jobs.append([*nb_cmd, "-o", str(nb_staged)])
    ext_objs = [work / (src + ".o") for src in EXT_SOURCES]
    for src, obj in zip(EXT_SOURCES, ext_objs, strict=True):
        jobs.append(
            [cxx, *nb_flags, *EXT_FLAGS.get(src, []), "-DNB_DOMAIN=mlx"]
            + [f"-DMLXSERVE_EXT_NAME={name}"]
            + ["-I", paths["mlx_include"], "-I", str(CSRC), "-c", str(CSRC / src)]
            + ["-o", str(obj)]
        )
    _run_parallel(jobs)
    if not nb_obj.exists():
        os.replace(nb_staged, nb_obj)  # atomic, as the extension itself
    link = [cxx, "-shared", "-o", str(out), *map(str, ext_objs), str(nb_obj), *map(str, objects)]
    link += ["-L", paths["mlx_lib"], "-lmlx", f"-Wl,-rpath,{paths['mlx_lib']}", "-lpthread"]
    _run_parallel([link])


def _run_parallel(jobs: list[list[str]]) -> None:
    """Run compiler commands, os.cpu_count() at a time; BuildError with the first failure."""
    width = max(1, os.cpu_count() or 1)
    pending = list(jobs)
    while pending:
        batch, pending = pending[:width], pending[width:]
        procs = [
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for cmd in batch
        ]
        for cmd, proc in zip(batch, procs, strict=True):
            try:
                log, _ = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise BuildError(f"compiling timed out: {' '.join(cmd[:4])} ...") from None
            if proc.returncode != 0:
                raise BuildError(f"{' '.join(cmd)} failed:\n{log.strip()[-1500:]}")


def built_path() -> Path:
    """Where the extension for this mlx/nanobind/Python lives once built."""
    tag, _ = _inputs()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_dir() / f"{module_name(tag)}{suffix}"


def build(log=None) -> Path:
    """The cached extension's path, compiling it first if needed (one builder at a time)."""
    if sys.platform == "win32":
        raise BuildError("not supported on Windows")
    tag, paths = _inputs()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = cache_dir() / f"{module_name(tag)}{suffix}"
    if out.exists():
        return out
    _compilers()  # no compiler: say so before announcing a build
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".lock-{tag}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same one
        if out.exists():
            return out
        if log is not None:
            log(f"compiling mlxserve's CPU kernels once (~30 s; cached in {out.parent})")
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            staged = Path(tmp) / out.name
            _compile_all(paths, module_name(tag), Path(tmp), staged)
            os.replace(staged, out)  # atomic: nobody loads a half-written file
    return out


def load(path: Path) -> ModuleType:
    """Import the built extension from its cache path."""
    name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise BuildError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
