"""A drop-in for ``mx.fast.metal_kernel`` that runs the kernel on the CPU emulator.

``Emulator().metal_kernel(name, input_names, output_names, source, ...)`` returns a callable
with the same keyword arguments as MLX's (``inputs, output_shapes, output_dtypes, grid,
threadgroup, template, init_value, verbose, stream``), so mlxserve's ops code runs unchanged
against it. Calls are eager: inputs are evaluated, the kernel runs, outputs come back as
evaluated arrays.

Inputs are read-only, as MLX's contract has them (``const device``, and MLX tracks only
outputs): a kernel that writes through an input pointer anyway (a ``const_cast``) is
reported as a KernelError, never propagated to the array. Outputs start
as NaN (all bits set) unless ``init_value`` is given, so elements a kernel forgets to write
show up. Every buffer ends at a guard page, so reading or writing past its end is reported.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from metal.checker import build
from metal.checker.signature import TYPE_STRINGS, Generated, dtype_name, generate_for_call

_lib: ctypes.CDLL | None = None
# Thread orders (emu_runtime.cpp): queue order ascending / descending, or one simdgroup at a
# time from the lowest / highest (so a simdgroup runs ahead to the next threadgroup barrier).
SCHEDULES = ("forward", "reverse", "serial", "serial-reverse")


class KernelError(RuntimeError):
    """The emulated kernel diverged, deadlocked, faulted or timed out."""


def _runtime() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build.runtime_library()), mode=ctypes.RTLD_GLOBAL)
        lib.mlxs_alloc.restype = ctypes.c_void_p
        lib.mlxs_alloc.argtypes = [ctypes.c_ulong]
        lib.mlxs_free.argtypes = [ctypes.c_void_p, ctypes.c_ulong]
        lib.mlxs_run.restype = ctypes.c_int
        lib.mlxs_run.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_double,
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_ulong),
        ]
        _lib = lib
    return _lib


_loaded: dict[str, ctypes.CDLL] = {}


def _entry_point(lib_path, symbol: str) -> int:
    _runtime()  # kernel libraries resolve mlxs_* against the runtime
    lib = _loaded.get(str(lib_path))
    if lib is None:
        lib = _loaded[str(lib_path)] = ctypes.CDLL(str(lib_path))
    return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value


def _np_view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated MLX array's memory (bfloat16 as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.asarray(a)


def _to_mx(buf: np.ndarray, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    out = mx.array(buf.copy())
    if dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    return out.reshape(shape)


class _Guarded:
    """A buffer in emulator memory that ends at a guard page."""

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = max(nbytes, 1)
        self.ptr = _runtime().mlxs_alloc(self.nbytes)
        if not self.ptr:
            raise MemoryError("mlxs_alloc failed")

    def array(self, dtype, count: int) -> np.ndarray:
        raw = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=np.uint8, count=self.nbytes)[
            : count * np.dtype(dtype).itemsize
        ].view(dtype)

    def free(self) -> None:
        _runtime().mlxs_free(self.ptr, self.nbytes)


@dataclass
class Emulator:
    """Settings for emulated kernels; ``metal_kernel`` is the mx.fast.metal_kernel stand-in.

    schedules: run each launch under these fiber orders (of SCHEDULES) and require
    bitwise-identical results, so a missing barrier (a race) cannot hide behind one order.
    """

    schedules: tuple[str, ...] = ("forward",)
    timeout_s: float = 60.0
    stack_kb: int = 64
    launches: list[dict] = field(default_factory=list)  # what ran, for tests

    def __post_init__(self) -> None:
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(f"schedules must be some of {SCHEDULES}, got {self.schedules}")

    def metal_kernel(
        self,
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options: dict | None = None,
    ) -> EmulatedKernel:
        """Same arguments as mx.fast.metal_kernel."""
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        return EmulatedKernel(
            self,
            name,
            list(input_names),
            list(output_names),
            source,
            header,
            ensure_row_contiguous,
            atomic_outputs,
        )


def _as_array(x) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x, dtype=mx.bool_)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32)
    return mx.array(x, dtype=mx.float32)


@dataclass
class EmulatedKernel:
    emulator: Emulator
    name: str
    input_names: list[str]
    output_names: list[str]
    source: str
    header: str
    ensure_row_contiguous: bool
    atomic_outputs: bool

    def generated(self, inputs: list[mx.array], output_dtypes, template) -> Generated:
        return generate_for_call(
            self.name,
            self.input_names,
            self.output_names,
            self.source,
            self.header,
            inputs,
            output_dtypes,
            template,
            self.atomic_outputs,
        )

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ) -> list[mx.array]:
        inputs = [_as_array(x) for x in inputs]
        if len(output_shapes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_shapes` to have size "
                f"{len(self.output_names)} but got size {len(output_shapes)}."
            )
        mx.eval(inputs)
        g = self.generated(inputs, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{g.source}\n```")
        found = build.lookup(g)
        if found is None:
            build.compile_variants([g])
            found = build.lookup(g)
        entry = _entry_point(*found)
        return self._launch(
            g, entry, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value
        )

    def _launch(
        self, g, entry, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value
    ) -> list[mx.array]:
        emu = self.emulator
        views = [_np_view(a) for a in inputs]
        # MLX copies non-row-contiguous inputs first (ensure_row_contiguous).
        originals = [v if v.flags.c_contiguous else np.ascontiguousarray(v) for v in views]
        if not self.ensure_row_contiguous and any(not v.flags.c_contiguous for v in views):
            raise NotImplementedError("the emulator needs row-contiguous inputs")
        outs_np = [np.dtype(TYPE_STRINGS[dtype_name(d)][1]) for d in output_dtypes]
        guarded: list[_Guarded] = []
        nbuf = max((p.buffer for p in g.params if p.buffer is not None), default=-1) + 1
        args = (ctypes.c_void_p * nbuf)()
        in_bufs: list[tuple[_Guarded, np.ndarray]] = []
        out_bufs: list[tuple[_Guarded, np.ndarray]] = []
        try:
            for p in g.params:
                if p.kind == "input":
                    src = originals[p.input_index]
                    buf = _Guarded(p.name, src.nbytes)
                    in_bufs.append((buf, src))
                elif p.kind in ("shape", "strides", "ndim"):
                    a = originals[p.input_index]
                    vals = {
                        "shape": np.asarray(a.shape, np.int32),
                        "strides": np.asarray([s // a.itemsize for s in a.strides], np.int64),
                        "ndim": np.asarray([a.ndim], np.int32),
                    }[p.kind]
                    buf = _Guarded(p.name, vals.nbytes)
                    buf.array(vals.dtype, vals.size)[:] = vals
                else:
                    continue
                guarded.append(buf)
                args[p.buffer] = buf.ptr
            for p in g.params:
                if p.kind == "output":
                    j = p.output_index
                    count = int(np.prod(output_shapes[j])) if len(output_shapes[j]) else 1
                    buf = _Guarded(p.name, count * outs_np[j].itemsize)
                    guarded.append(buf)
                    out_bufs.append((buf, np.empty(count, outs_np[j])))
                    args[p.buffer] = buf.ptr
            results = []
            for schedule in emu.schedules:
                for buf, src in in_bufs:
                    buf.array(src.dtype, src.size)[:] = src.reshape(-1)
                for (buf, arr), dt in zip(out_bufs, output_dtypes, strict=True):
                    mem = buf.array(arr.dtype, arr.size)
                    if init_value is None:
                        mem.view(np.uint8)[:] = 0xFF
                    else:
                        mem[:] = _fill_value(init_value, dt, arr.dtype)
                self._run(entry, args, grid, threadgroup, SCHEDULES.index(schedule), guarded)
                results.append(
                    [buf.array(a.dtype, a.size).copy() for buf, a in out_bufs]
                    + [buf.array(src.dtype, src.size).copy() for buf, src in in_bufs]
                )
            for other, schedule in zip(results[1:], emu.schedules[1:], strict=True):
                for k, (x, y) in enumerate(zip(results[0], other, strict=True)):
                    if x.tobytes() != y.tobytes():
                        what = (out_bufs + in_bufs)[k][0].name
                        raise KernelError(
                            f"{g.kernel_name}: `{what}` differs between the {emu.schedules[0]} and "
                            f"{schedule} thread schedules: a race (missing barrier?)"
                        )
            final = results[0]
            for k, (_, src) in enumerate(in_bufs):
                if final[len(out_bufs) + k].tobytes() != src.reshape(-1).tobytes():
                    raise KernelError(
                        f"{g.kernel_name}: writes its input `{self.input_names[k]}`; inputs "
                        "are read-only (MLX tracks only a kernel's outputs)"
                    )
            emu.launches.append(
                {
                    "kernel": g.kernel_name,
                    "name": self.name,
                    "grid": tuple(grid),
                    "threadgroup": tuple(threadgroup),
                }
            )
            return [
                _to_mx(final[j], output_dtypes[j], tuple(output_shapes[j]))
                for j in range(len(out_bufs))
            ]
        finally:
            for buf in guarded:
                buf.free()

    def _run(self, entry, args, grid, threadgroup, schedule, guarded) -> None:
        lib = _runtime()
        err = ctypes.create_string_buffer(8192)
        fault = ctypes.c_ulong(0)
        code = lib.mlxs_run(
            entry,
            args,
            (ctypes.c_uint * 3)(*grid),
            (ctypes.c_uint * 3)(*threadgroup),
            schedule,
            self.emulator.stack_kb,
            self.emulator.timeout_s,
            err,
            len(err),
            ctypes.byref(fault),
        )
        if code:
            msg = err.value.decode(errors="replace")
            if fault.value:
                msg += _locate(fault.value, guarded)
            raise KernelError(f"{self.name}: {msg}")


def _fill_value(value: float, dtype: mx.Dtype, storage: np.dtype):
    if dtype == mx.bfloat16:
        return np.asarray(mx.array(value, dtype=mx.bfloat16).view(mx.uint16)).astype(storage)
    return np.asarray(value).astype(storage)


def _locate(addr: int, guarded: list[_Guarded]) -> str:
    for buf in guarded:
        end = buf.ptr + ((buf.nbytes + 7) // 8) * 8
        if buf.ptr - 65536 <= addr < buf.ptr:
            return f" ({buf.ptr - addr} bytes before the start of `{buf.name}`)"
        if end <= addr < end + (16 << 20):
            return f" ({addr - buf.ptr - buf.nbytes} bytes past the end of `{buf.name}`)"
    return ""


DEFAULT = Emulator()


def metal_kernel(*args, **kwargs) -> EmulatedKernel:
    """mx.fast.metal_kernel, emulated with default settings."""
    return DEFAULT.metal_kernel(*args, **kwargs)
