"""The compilers the checker uses: g++ (emulator, C++20 check) and a clang fit for the shim.

The address-space check needs a clang that compiles ``metal_stdlib.h`` in its
``MLXS_AS_CHECK`` mode: x86 ``_Float16`` and ``__bf16`` arithmetic, clang >= 17 (Debian 12's
default clang-14 rejects both). Each candidate is tried on the shim itself rather than
judged by its version, in this order:

    $MLXSERVE_CLANG                 this one only (the tests fail, not skip, if it is unfit)
    clang++ / clang on PATH         a system clang (`apt-get install clang-19` on Debian 12)
    clang++-N / clang-N on PATH     Debian/Ubuntu's versioned names, newest first
    python -m ziglang clang         the PyPI package ziglang (extra `metal-check`, ~400 MB)

With none fit, ``Toolchain.clang`` is None and ``clang_missing_reason`` says what was
tried and how to get one; the tests then skip the clang check saying so (or fail it, when
``MLXSERVE_REQUIRE_CLANG=1``, as CI sets).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "metal_stdlib.h"
CLANG_FLAGS = [
    "-cc1",
    "-fsyntax-only",
    "-std=c++14",
    "-triple",
    "x86_64-unknown-linux-gnu",
    "-Wno-unknown-attributes",
    "-Werror",
]
# Versioned names searched on PATH (clang-17 is the oldest that compiles the shim).
CLANG_VERSIONS = range(40, 16, -1)
INSTALL_HINT = (
    "get one with `apt-get install clang-19` (Debian 12; any clang >= 17), "
    "`pip install -e '.[metal-check]'` in the mlxserve clone (ziglang's clang), or set "
    "MLXSERVE_CLANG"
)


class CompileError(RuntimeError):
    """A kernel failed to compile; the message carries the compiler's diagnostics."""


@dataclass(frozen=True)
class Toolchain:
    """g++ (always) and the clang for the address-space check (None: none fit)."""

    gxx: list[str]
    clang: list[str] | None
    clang_missing_reason: str = ""


def find_toolchain() -> Toolchain:
    """g++ from $MLXSERVE_CXX or PATH; clang as the module docstring says."""
    gxx = os.environ.get("MLXSERVE_CXX") or shutil.which("g++")
    if not gxx:
        raise CompileError("g++ not found: the Metal checker needs g++ (C++20)")
    clang, reason = _find_clang(os.environ.get("MLXSERVE_CLANG", ""), os.environ.get("PATH", ""))
    return Toolchain([gxx], list(clang) if clang else None, reason)


@functools.cache
def _find_clang(explicit: str, path: str) -> tuple[tuple[str, ...] | None, str]:
    """(the first fit clang command, '') or (None, why not); cached per environment."""
    if explicit:
        cmd = tuple(explicit.split())
        problem = shim_problem(cmd)
        if problem is None:
            return cmd, ""
        return None, f"MLXSERVE_CLANG={explicit!r} cannot check the shim: {problem}"
    rejected = []
    for cmd in _candidates(path):
        problem = shim_problem(cmd)
        if problem is None:
            return cmd, ""
        rejected.append(f"{' '.join(cmd)}: {problem}")
    tried = "; ".join(rejected) if rejected else "no clang on PATH and no ziglang package"
    return None, f"no clang fit for the address-space check ({tried}); {INSTALL_HINT}"


def _candidates(path: str) -> list[tuple[str, ...]]:
    """System clangs on ``path`` (each binary once), then ziglang's."""
    names = ["clang++", "clang"]
    for v in CLANG_VERSIONS:
        names += [f"clang++-{v}", f"clang-{v}"]
    found: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for name in names:
        exe = shutil.which(name, path=path)
        if exe and os.path.realpath(exe) not in seen:
            seen.add(os.path.realpath(exe))
            found.append((exe,))
    if importlib.util.find_spec("ziglang") is not None:
        found.append((sys.executable, "-m", "ziglang", "clang"))  # `-cc1` needs no zig cache
    return found


def shim_problem(cmd: tuple[str, ...]) -> str | None:
    """None when ``cmd`` compiles the shim in address-space mode, else its first error."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(f'#define MLXS_AS_CHECK 1\n#include "{SHIM}"\n')
        try:
            proc = subprocess.run(
                [*cmd, *CLANG_FLAGS, "-x", "c++", str(src)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot run it ({e})"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).splitlines()
    errors = [line for line in lines if "error:" in line]
    first = (errors or lines or [f"exit status {proc.returncode}"])[0]
    return first.split("error:", 1)[-1].strip()
