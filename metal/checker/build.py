"""Compile generated kernel sources: g++ for the emulator, clang for address-space checks.

Each kernel variant (one ``Generated`` source) becomes a namespace in a C++ translation unit
that includes the ``metal_stdlib.h`` shim. The text inside is MLX's, with three mechanical
changes that keep its meaning: ``#line`` markers so diagnostics name the kernel file,
``threadgroup T x[N];`` declarations turned into ``MLXS_TG_VAR`` (shared per threadgroup in
the emulator, ``static`` for clang), and, for clang only, the attribute list removed from
MLX's explicit instantiation (a Metal-only placement that plain clang rejects).

Compiled libraries are cached by content hash in ``$MLXSERVE_METAL_CACHE`` (default
``~/.cache/mlxserve/metal-checker``), outside the repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from metal.checker.signature import Generated
from metal.checker.toolchain import CLANG_FLAGS, CompileError, find_toolchain

CHECKER_DIR = Path(__file__).resolve().parent
KERNEL_DIR = CHECKER_DIR.parent
SHIM = CHECKER_DIR / "metal_stdlib.h"
RUNTIME = CHECKER_DIR / "emu_runtime.cpp"

GXX_FLAGS = ["-std=c++20", "-O0", "-fPIC", "-shared", "-w", "-fno-exceptions"]
RUNTIME_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-shared", "-Wall"]

# Offsets of the thread attributes in the per-thread id block (emu_runtime.cpp, ids_for).
ATTR_OFFSETS = {
    "thread_position_in_grid": 0,
    "threads_per_threadgroup": 3,
    "threadgroup_position_in_grid": 6,
    "thread_position_in_threadgroup": 9,
    "threadgroups_per_grid": 12,
    "threads_per_grid": 15,
    "grid_size": 15,
    "grid_origin": 18,
    "dispatch_threads_per_threadgroup": 21,
    "thread_index_in_threadgroup": 24,
    "simdgroup_index_in_threadgroup": 25,
    "thread_index_in_simdgroup": 26,
    "threads_per_simdgroup": 27,
    "simdgroups_per_threadgroup": 28,
    "thread_execution_width": 29,
    "quadgroup_index_in_threadgroup": 30,
    "quadgroups_per_threadgroup": 31,
    "thread_index_in_quadgroup": 32,
    "dispatch_simdgroups_per_threadgroup": 33,
    "dispatch_quadgroups_per_threadgroup": 34,
}

_TG_DECL = re.compile(
    r"^(?P<indent>[ \t]*)threadgroup[ \t]+(?P<type>[A-Za-z_][\w:<>, ]*?)[ \t]+"
    r"(?P<name>[A-Za-z_]\w*)[ \t]*(?P<dims>(?:\[[^\];\n]+\])*)[ \t]*;",
    re.MULTILINE,
)
_INSTANTIATION_ATTRS = re.compile(
    r"^template \[\[host_name\(\"[^\"]*\"\)\]\] \[\[kernel\]\] ", re.M
)


def cache_dir() -> Path:
    base = os.environ.get("MLXSERVE_METAL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "mlxserve",
        "metal-checker",
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _origin(text: str) -> str | None:
    """The kernel file (e.g. metal/paged_decode.metal) that `text` is, or is an edited copy
    of (same first line; line numbers then hold up to the first edit)."""
    if not text:
        return None
    first = text.split("\n", 1)[0]
    for path in sorted(KERNEL_DIR.glob("*.metal")):
        content = path.read_text()
        if content == text:
            return f"metal/{path.name}"
        if first.startswith("//") and content.split("\n", 1)[0] == first:
            return f"metal/{path.name} (edited copy)"
    return None


def rewrite_threadgroup_decls(body: str) -> str:
    """`threadgroup T x[N];` -> `MLXS_TG_VAR(T, x, [N]);` on the same line."""

    def sub(m: re.Match) -> str:
        return f"{m['indent']}MLXS_TG_VAR({m['type']}, {m['name']}, {m['dims']});"

    return _TG_DECL.sub(sub, body)


def translation_unit(variants: list[Generated], mode: str) -> str:
    """C++ text for `variants` in mode 'emulate' (g++) or 'as_check' (clang)."""
    assert mode in ("emulate", "as_check")
    out = [
        "#define MLXS_EMULATE 1\n" if mode == "emulate" else "#define MLXS_AS_CHECK 1\n",
        f'#include "{SHIM}"\n',
    ]
    for i, g in enumerate(variants):
        head_origin = _origin(g.header) or f"{g.kernel_name}:header"
        body_origin = _origin(g.body) or f"{g.kernel_name}:body"
        inst = g.instantiation
        if mode == "as_check":
            inst = _INSTANTIATION_ATTRS.sub("template ", inst)
        out.append(f"namespace mlxs_v{i} {{\n")
        if g.header:
            out.append(f'#line 1 "{head_origin}"\n{rewrite_threadgroup_decls(g.header)}')
            if not g.header.endswith("\n"):
                out.append("\n")
        out.append(f'#line 1 "{g.kernel_name}:signature"\n{g.signature}')
        out.append(f'#line 1 "{body_origin}"\n{rewrite_threadgroup_decls(g.body)}')
        out.append(f'\n#line 1 "{g.kernel_name}:end"\n}}\n{inst}')
        out.append(f"}}  // namespace mlxs_v{i}\n")
        if mode == "emulate":
            out.append(_trampoline(g, i))
    return "".join(out)


def _trampoline(g: Generated, i: int) -> str:
    args = []
    for p in g.params:
        if p.kind == "attr":
            off = ATTR_OFFSETS[p.name]
            if p.ctype == "uint3":
                args.append(f"uint3{{id[{off}], id[{off + 1}], id[{off + 2}]}}")
            else:
                args.append(f"id[{off}]")
        elif p.kind == "output":
            if p.ctype.startswith("atomic<"):
                raise CompileError("the emulator does not support atomic_outputs")
            args.append(f"({p.ctype}*)a[{p.buffer}]")
        elif p.is_ref:
            args.append(f"*(const {p.ctype}*)a[{p.buffer}]")
        else:
            args.append(f"(const {p.ctype}*)a[{p.buffer}]")
    fn = f"mlxs_v{i}::{g.kernel_name}{g.template_def}"
    return (
        f'extern "C" void mlxs_entry_{i}(void** a, const unsigned* id) {{\n'
        f"  {fn}(\n    " + ",\n    ".join(args) + ");\n}\n"
    )


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"{what} failed:\n{proc.stderr.strip() or proc.stdout.strip()}")


def runtime_library() -> Path:
    """Build (once, cached) the emulator runtime shared library."""
    tc = find_toolchain()
    text = RUNTIME.read_text()
    lib = cache_dir() / f"libmlxs_emu_{_digest(text, ' '.join(tc.gxx + RUNTIME_FLAGS))}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        _run([*tc.gxx, *RUNTIME_FLAGS, str(RUNTIME), "-o", str(tmp)], "building emu_runtime.cpp")
        os.replace(tmp, lib)
    return lib


def variant_key(g: Generated) -> str:
    # "v2": libraries built before batch names included the shim text may hold an old shim.
    return _digest(g.source, SHIM.read_text(), " ".join(GXX_FLAGS), "v2")


def lookup(g: Generated) -> tuple[Path, str] | None:
    """(library, symbol) of an already compiled variant."""
    index = cache_dir() / f"{variant_key(g)}.json"
    if not index.exists():
        return None
    entry = json.loads(index.read_text())
    lib = cache_dir() / entry["lib"]
    return (lib, entry["symbol"]) if lib.exists() else None


def compile_variants(variants: list[Generated], jobs: int | None = None) -> None:
    """Compile every not-yet-cached variant for the emulator, in parallel batches."""
    todo: dict[str, Generated] = {}
    for g in variants:
        if lookup(g) is None:
            todo.setdefault(variant_key(g), g)
    if not todo:
        return
    tc = find_toolchain()
    items = list(todo.items())
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(items)))
    # Several batches per job so a slow one does not hold up the rest.
    nbatch = min(len(items), jobs * 2)
    batches = [items[k::nbatch] for k in range(nbatch)]

    def build(batch: list[tuple[str, Generated]]) -> None:
        tu = translation_unit([g for _, g in batch], "emulate")
        # The shim is #included by path: its text must be part of the name, or an edited shim
        # would reuse a library built from the old one.
        name = f"batch_{_digest(tu, SHIM.read_text(), ' '.join(tc.gxx + GXX_FLAGS))}"
        lib = cache_dir() / f"{name}.so"
        if not lib.exists():
            src = cache_dir() / f"{name}.{os.getpid()}.cpp"
            src.write_text(tu)
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            try:
                _run([*tc.gxx, *GXX_FLAGS, str(src), "-o", str(tmp)], "g++ (emulator build)")
            finally:
                src.unlink(missing_ok=True)
            os.replace(tmp, lib)
        for i, (key, _) in enumerate(batch):
            entry = json.dumps({"lib": lib.name, "symbol": f"mlxs_entry_{i}"})
            path = cache_dir() / f"{key}.json"
            tmp_index = path.with_suffix(f".{os.getpid()}.tmp")
            tmp_index.write_text(entry)
            os.replace(tmp_index, path)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for fut in [pool.submit(build, b) for b in batches]:
            fut.result()


def static_check(
    variants: list[Generated],
    jobs: int | None = None,
    modes: tuple[str, ...] = ("emulate", "as_check"),
) -> None:
    """Compile every variant with g++ (C++20, mode 'emulate') and with clang in
    address-space mode ('as_check').

    Raises CompileError naming the kernel file and line of the first failure, or saying
    why there is no clang for 'as_check'.
    """
    tc = find_toolchain()
    if "as_check" in modes and tc.clang is None:
        raise CompileError(tc.clang_missing_reason)
    work = []
    tmpdir = cache_dir() / "static-check"
    tmpdir.mkdir(exist_ok=True)
    for mode in modes:
        for k in range(0, len(variants), 16):
            chunk = variants[k : k + 16]
            tu = translation_unit(chunk, mode)
            src = tmpdir / f"{mode}_{_digest(tu)}.cpp"
            src.write_text(tu)
            if mode == "emulate":
                cmd = [
                    *tc.gxx,
                    "-std=c++20",
                    "-fsyntax-only",
                    "-Wall",
                    "-Wno-attributes",
                    "-Wno-unused",
                    "-Werror",
                    str(src),
                ]
                work.append((cmd, "g++ -std=c++20"))
            else:
                work.append(
                    ([*tc.clang, *CLANG_FLAGS, "-x", "c++", str(src)], "clang address-space check")
                )
    jobs = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for fut in [pool.submit(_run, cmd, what) for cmd, what in work]:
            fut.result()
