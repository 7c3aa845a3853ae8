"""An optimized BLAS under MLX's CPU backend on Linux (optional, measured, reversible).

MLX's Linux CPU wheel links a reference BLAS (~2-3 GFLOP/s for float32 matmul). libmlx
calls ``cblas_sgemm`` through its PLT, so after libmlx is loaded mlxserve points that
call's GOT slot at an optimized sgemm: every float32 matmul of MLX then runs there. This
needs no compiler, works whether or not mlx was imported first, and also binds libraries
whose symbols are prefixed (PyPI's scipy-openblas32 exports ``scipy_cblas_sgemm``).

The choice is ``mlxserve.settings.Settings.blas`` (default: $MLXSERVE_BLAS), passed in by
the caller (mlxserve.settings.start, when a model is made or a command starts):

    MLXSERVE_BLAS=auto (default)  OpenBLAS from PyPI (scipy-openblas32, a dependency on
                                  Linux), else a system OpenBLAS (libopenblas0-pthread)
    MLXSERVE_BLAS=off             keep MLX's bundled BLAS
    MLXSERVE_BLAS=/path/lib.so    this library (``cblas_sgemm`` or ``scipy_cblas_sgemm``)

PyPI's OpenBLAS is preferred: on the 2-core x86 machine of bench/README.md it ran 30-64
GFLOP/s per core where Debian 12's 0.3.21 ran ~10. On macOS nothing happens: MLX uses
Accelerate on the CPU and Metal on the GPU.

OpenBLAS's sgemm packs the whole weight matrix even for one row of activations, so a
single decoding request runs ~3-4x below memory bandwidth. ``csrc/sgemm_gemv.c`` is an
sgemm that hands one-row products to sgemv and everything else to OpenBLAS; it is
compiled once with the system C compiler into a cache folder, and the slot points at it
(``Settings.blas_gemv``):

    MLXSERVE_BLAS_GEMV=auto (default)  use it when a C compiler (cc/gcc) exists
    MLXSERVE_BLAS_GEMV=off             plain OpenBLAS sgemm for every shape

When no optimized BLAS can be bound, one warning says so and how to fix it.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblaso.so.0",
    "/usr/lib/libopenblas.so.0",
]
PREFIXES = ("", "scipy_")  # cblas_sgemm (system OpenBLAS), scipy_cblas_sgemm (PyPI)
FIX = (
    "pip install scipy-openblas32 (or apt install libopenblas0-pthread), or set "
    "MLXSERVE_BLAS=/path/to/libopenblas.so"
)

_state: dict[str, str | None] = {
    "path": None,
    "source": None,
    "reason": "not attempted",
    "gemv": None,
    "gemv_reason": "not attempted",
}
_OFF = ("off", "0", "no", "false", "none")
_SHIM_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "sgemm_gemv.c"
_keep: list[ctypes.CDLL] = []  # libraries whose functions the GOT slot points into


def pypi_openblas() -> str | None:
    """Path of scipy-openblas32's library (found without importing it), or None."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "lib", "libscipy_openblas*.so*")))
        if found:
            return found[0]
    return None


def system_openblas() -> str | None:
    """Path of a system OpenBLAS (Debian/Ubuntu/Fedora locations), or None."""
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    found = sorted(glob.glob("/usr/lib/*/openblas*/libopenblas*.so*"))
    return found[0] if found else None


def preload(choice: str = "auto", gemv: bool = True) -> None:
    """Bind an optimized BLAS under MLX if allowed and possible (once; Linux only).

    ``choice``: "auto", "off" or a library path; ``gemv``: one-row products through the
    sgemv shim (mlxserve.settings gives both)."""
    if _state["reason"] != "not attempted":
        return
    choice = choice.strip()
    if sys.platform != "linux":
        _state["reason"] = "not Linux: MLX's own BLAS (Accelerate) is used"
        return
    if choice.lower() in _OFF:
        _state["reason"] = "MLXSERVE_BLAS=off"
        return
    if choice.lower() in ("", "auto"):
        found = [(p, s) for p, s in ((pypi_openblas(), "pypi"), (system_openblas(), "system"))]
        found = [(p, s) for p, s in found if p is not None]
        if not found:
            _state["reason"] = "no OpenBLAS found"
    else:
        found = [(choice, "MLXSERVE_BLAS")]
    for path, source in found:
        if _bind(path, source, gemv):
            break
    if _state["path"] is None:
        logger.warning(
            "no optimized BLAS under MLX (%s): float32 matmuls run at ~2-3 GFLOP/s; %s",
            _state["reason"],
            FIX,
        )


def _bind(path: str, source: str, gemv: bool) -> bool:
    """Point libmlx's cblas_sgemm at ``path``'s sgemm (through the gemv shim if built)."""
    try:
        lib = ctypes.CDLL(path)
        prefix = next(p for p in PREFIXES if hasattr(lib, f"{p}cblas_sgemm"))
        sgemm, sgemv = getattr(lib, f"{prefix}cblas_sgemm"), getattr(lib, f"{prefix}cblas_sgemv")
    except (OSError, StopIteration, AttributeError) as e:
        why = e if not isinstance(e, StopIteration) else "no cblas_sgemm / scipy_cblas_sgemm"
        _state["reason"] = f"could not load {path}: {why}"
        return False
    as_ptr = ctypes.cast
    target = as_ptr(sgemm, ctypes.c_void_p).value
    shim = _load_gemv_shim(gemv)
    if shim is not None:
        shim.mlxserve_bind(as_ptr(sgemm, ctypes.c_void_p), as_ptr(sgemv, ctypes.c_void_p))
        target = as_ptr(shim.mlxserve_sgemm, ctypes.c_void_p).value
    try:
        import mlx.core as mx

        old = patch_got(_libmlx(), "cblas_sgemm", target)
    except (OSError, RuntimeError, ValueError) as e:
        _state["reason"] = f"could not bind {path} under MLX: {e}"
        return False
    if not _matmul_is_right(mx):  # never keep a BLAS that computes wrong answers
        for slot, value in old:
            _write_slot(slot, value)
        _state["reason"] = f"{path} gave a wrong float32 matmul under MLX: not used"
        return False
    _keep.extend([lib] + ([shim] if shim is not None else []))
    _state.update(path=path, source=source, reason=f"OpenBLAS bound from {path} ({source})")
    _state["gemv"] = shim._name if shim is not None else None
    return True


def _matmul_is_right(mx) -> bool:
    """A small float32 matmul through the newly bound sgemm against a float64 sum."""
    a = [[(i * 7 + j * 3) % 11 - 5.0 for j in range(24)] for i in range(5)]
    b = [[(i * 5 + j * 2) % 13 - 6.0 for j in range(24)] for i in range(9)]
    want = [[sum(x * y for x, y in zip(r, c, strict=True)) for c in b] for r in a]
    got = (mx.array(a) @ mx.array(b).T).tolist()  # small integers: exact in float32
    return got == want and (mx.array(a[:1]) @ mx.array(b).T).tolist() == want[:1]


def _libmlx() -> str:
    """Path of the libmlx shared library this process has loaded."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("libmlx.so"):
                return path
    raise RuntimeError("libmlx.so is not loaded (MLX built without a shared libmlx?)")


def patch_got(library: str, symbol: str, address: int) -> list[tuple[int, int]]:
    """Point every GOT slot of loaded ``library`` that resolves ``symbol`` at ``address``.

    Returns (slot, previous value) pairs; raises RuntimeError when there is no such slot.
    """
    lib = ctypes.CDLL(library)  # already loaded: the same instance, its load bias below
    link_map = ctypes.c_void_p()
    libc = ctypes.CDLL(None)
    if libc.dlinfo(ctypes.c_void_p(lib._handle), 2, ctypes.byref(link_map)) != 0:  # LINKMAP
        raise RuntimeError(f"dlinfo failed for {library}")
    bias = ctypes.c_size_t.from_address(link_map.value).value  # link_map.l_addr
    offsets = _got_offsets(Path(library).read_bytes(), symbol)
    if not offsets:
        raise RuntimeError(f"{library} has no relocation for {symbol}")
    old = []
    for offset in offsets:
        slot = bias + offset
        old.append((slot, ctypes.c_void_p.from_address(slot).value or 0))
        _write_slot(slot, address)
    return old


def _write_slot(slot: int, value: int) -> None:
    """Write a pointer into a GOT slot, lifting RELRO's read-only page for the write."""
    page = slot & ~(os.sysconf("SC_PAGE_SIZE") - 1)
    writable = _is_writable(slot)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = os.sysconf("SC_PAGE_SIZE")
    if not writable and libc.mprotect(page, size, 3) != 0:  # PROT_READ | PROT_WRITE
        raise OSError(ctypes.get_errno(), "mprotect failed on libmlx's GOT")
    ctypes.c_void_p.from_address(slot).value = value
    if not writable:
        libc.mprotect(page, size, 1)  # back to PROT_READ


def _is_writable(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return "w" in perms
    raise RuntimeError(f"address {address:#x} is not mapped")


# ELF64 little-endian: the relocation types that fill a GOT slot with a symbol's address.
_GOT_RELOCS = {62: (6, 7), 183: (1025, 1026)}  # x86_64 GLOB_DAT/JUMP_SLOT, aarch64 same


def _got_offsets(elf: bytes, symbol: str) -> list[int]:
    """Virtual offsets of the GOT slots relocated against ``symbol`` in an ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    machine = struct.unpack_from("<H", elf, 0x12)[0]
    if machine not in _GOT_RELOCS:
        raise ValueError(f"ELF machine {machine} is not x86_64 or aarch64")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    wanted = symbol.encode()
    offsets = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 4 or not entsize:  # SHT_RELA
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for i in range(size // entsize):
            r_offset, r_info = struct.unpack_from("<QQ", elf, off + i * entsize)
            if r_info & 0xFFFFFFFF not in _GOT_RELOCS[machine]:
                continue
            entry = symtab[4] + (r_info >> 32) * symtab[9]  # Elf64_Sym; st_name comes first
            name_at = strtab[4] + struct.unpack_from("<I", elf, entry)[0]
            if elf[name_at : elf.index(b"\0", name_at)] == wanted:
                offsets.append(r_offset)
    return offsets


def _load_gemv_shim(gemv: bool) -> ctypes.CDLL | None:
    """Compile (once, cached) and load csrc/sgemm_gemv.c, or None saying why not."""
    if not gemv:
        _state["gemv_reason"] = "MLXSERVE_BLAS_GEMV=off"
        return None
    try:
        path = _build_shim()
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        _state["gemv_reason"] = f"not built: {e}"
        return None
    try:
        shim = ctypes.CDLL(str(path))
    except OSError as e:
        _state["gemv_reason"] = f"could not load {path}: {e}"
        return None
    _state["gemv_reason"] = f"one-row sgemm calls go to sgemv ({path})"
    return shim


def user_cache_dir() -> Path:
    """mlxserve's folder in the user's cache ($XDG_CACHE_HOME/mlxserve, else
    ~/.cache/mlxserve): the BLAS shim, the CPU kernels, the KV disk tier, launch's logs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxserve"


def shim_cache_dir() -> Path:
    """Where the compiled shim is kept."""
    return user_cache_dir() / "blas"


def _build_shim() -> Path:
    source = _SHIM_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    out = shim_cache_dir() / f"sgemm_gemv-{digest}.so"
    if out.exists():
        return out
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-shared", "-fPIC", str(_SHIM_SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
    return out


def fast_blas() -> str | None:
    """Path of the optimized BLAS MLX's float32 matmuls use, or None."""
    return _state["path"]


def gemv_shim() -> str | None:
    """Path of the loaded sgemm -> sgemv shim (one-row matmuls), or None."""
    return _state["gemv"]


def blas_info() -> dict[str, str | None]:
    """The BLAS choice as data (for ``mlxserve bench`` and a doctor command)."""
    return {
        "library": _state["path"],
        "source": _state["source"],  # pypi | system | MLXSERVE_BLAS | None
        "reason": _state["reason"],
        "gemv_shim": _state["gemv"],
        "gemv_reason": _state["gemv_reason"],
        "fix": FIX if _state["path"] is None and sys.platform == "linux" else None,
    }


def blas_status() -> str:
    """One line saying which BLAS MLX uses on the CPU, and why."""
    if _state["path"] is None:
        return str(_state["reason"])
    return f"{_state['reason']}; {_state['gemv_reason']}"
