"""The single dispatch point for attention kernels.

``paged_attention`` runs mlxserve's Metal kernels (``mlxserve.ops.metal``) when Metal is
available and the default stream is on the GPU; on MLX's CPU backend the CPU backend's
primitives (one op per layer for every row) when one is registered and its extension is
built, and the pure-MLX fallback otherwise (and when forced: it is the reference). The
CPU backend (``mlxserve.cpu.ops``) registers itself with :func:`register_cpu_backend`
when imported (the loader imports it); ops never imports it.
``write_kv`` is MLX's scatter on every backend (in place when the old pools can be
donated; why: ops/metal.py); on Metal, rows for 8-bit pools are quantized by a kernel
first. ``use_kernels(choice)`` ("auto", "metal" or "fallback", the engine's ``kernels``
setting) scopes a choice to the calling thread (a context variable: each engine's runner
scopes its own); ``check_kernels`` says at start-up whether a choice can run here.
Each kernel variant is self-tested on first use (ops/selftest.py): on failure "auto" falls
back for that op, "metal" raises. ``kernel_backend()`` says which implementation is in use
and why. An attention layer calls ``write_kv``, replaces its pool entries with the result
(the old ones must go for the write to be in place), then calls ``paged_attention``.

Per-layer variants: ``window`` (sliding-window attention) and ``sinks`` (gpt-oss's per-head
sink logits) run in both implementations; layers the kernels cannot take (K and V head sizes
differ, head_dim above 256) use the fallback even on Metal, logged once per reason.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar, Token
from dataclasses import dataclass
from functools import cache, lru_cache
from types import ModuleType
from typing import Protocol

import mlx.core as mx

from mlxserve.exceptions import ParameterError
from mlxserve.ops import fallback, kv_quant, selftest
from mlxserve.ops.metadata import AttentionMetadata, StateMetadata
from mlxserve.ops.metal import KernelFactory, MetalConfig, MetalKernels, unsupported_reason
from mlxserve.utils import uses_gpu

__all__ = [
    "AttentionMetadata",
    "CpuBackend",
    "StateMetadata",
    "check_kernels",
    "cpu_module",
    "force_backend",
    "kernel_backend",
    "metal_kernels",
    "paged_attention",
    "register_cpu_backend",
    "use_kernels",
    "write_kv",
]

logger = logging.getLogger("mlxserve")


@dataclass
class _Override:
    backend: str
    kernels: MetalKernels | None
    self_test: str | None  # selftest mode: "fallback", "raise", or None (no self-test)


class _ForcedChoices:
    """The forced choices in scope, innermost last: a context variable, not a process-wide
    list, so each thread (each engine's runner) scopes its own choice and others never see
    it. Falsy when nothing is forced here."""

    def __init__(self) -> None:
        self._stack: ContextVar[tuple[_Override, ...]] = ContextVar("mlxserve_ops", default=())

    def __bool__(self) -> bool:
        return bool(self._stack.get())

    def __getitem__(self, index: int) -> _Override:
        return self._stack.get()[index]

    def push(self, choice: _Override) -> Token:
        return self._stack.set((*self._stack.get(), choice))

    def pop(self, token: Token) -> None:
        self._stack.reset(token)


_override = _ForcedChoices()


class CpuBackend(Protocol):
    """What a CPU backend registers: compiled primitives for MLX's CPU and the attention
    ops on them (mlxserve.cpu.ops is one). Its functions are looked up on every call."""

    def primitives(self) -> ModuleType | None:
        """The loaded primitives, or None where they cannot be used here."""

    def status(self) -> str:
        """One line: the primitives in use, or why not."""

    def write_kv(
        self,
        module: ModuleType,
        k_cache: mx.array,
        v_cache: mx.array,
        keys: mx.array,
        values: mx.array,
        slot_mapping: mx.array,
    ) -> tuple[mx.array, mx.array]:
        """:func:`write_kv` on the primitives."""

    def paged_attention(
        self,
        module: ModuleType,
        q: mx.array,
        k_cache: mx.array,
        v_cache: mx.array,
        md: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """:func:`paged_attention` on the primitives."""


_cpu_backend: list[CpuBackend] = []  # the registered one, if any


def register_cpu_backend(backend: CpuBackend) -> None:
    """Make ``backend`` the CPU backend the ops dispatch to on MLX's CPU (the last one
    registered wins)."""
    _cpu_backend[:] = [backend]


def _forced() -> _Override | None:
    """The innermost forced choice in this thread's scope, or None ("auto")."""
    return _override[-1] if _override else None


def _metal_unavailable_reason() -> str | None:
    if not mx.metal.is_available():
        return "mx.metal.is_available() is False (no Metal device; MLX runs on its CPU backend)"
    if mx.default_device() != mx.Device(mx.gpu):
        return f"the default device is {mx.default_device()}, not the GPU"
    return None


def check_kernels(choice: str) -> None:
    """ParameterError naming the reason when kernel choice ``choice`` (one of
    config.KERNEL_CHOICES) cannot run on this machine: "metal" needs a Metal GPU; any
    choice but "fallback" needs valid Metal launch settings (MLXSERVE_METAL_PREFILL)."""
    if choice != "fallback":
        MetalConfig()  # a bad MLXSERVE_METAL_PREFILL is a ParameterError now, not mid-request
    reason = _metal_unavailable_reason() if choice == "metal" else None
    if reason:
        raise ParameterError(
            f"kernels='metal' (MLXSERVE_KERNELS), but Metal cannot run: {reason}",
            parameter="kernels",
        )


def use_kernels(choice: str) -> AbstractContextManager[object]:
    """Scope the engine's kernel choice: "auto" picks what the machine has."""
    if choice == "auto":
        return nullcontext()
    return force_backend(choice, self_test="raise" if choice == "metal" else None)


def kernel_backend() -> tuple[str, str]:
    """(backend, reason): which implementation the ops use right now, and why."""
    if (forced := _forced()) is not None:
        return forced.backend, "forced (kernels setting or ops.force_backend())"
    reason = _metal_unavailable_reason()
    if reason:
        if not _cpu_backend:
            return "fallback", f"{reason}; no CPU backend is registered"
        if _cpu_backend[0].primitives() is not None:
            return "cpu", f"{reason}; mlxserve's CPU kernels are loaded"
        return "fallback", f"{reason}; {_cpu_backend[0].status()}"
    return "metal", "Metal is available and the default stream is on the GPU"


def cpu_module() -> ModuleType | None:
    """The registered CPU backend's primitives when the ops use them now, else None: MLX
    on its CPU backend, the extension loaded (not MLXSERVE_CPU_KERNELS=off), and neither
    Metal nor the pure-MLX fallback forced. Models ask too (RMSNorm, RoPE)."""
    if not _cpu_backend:
        return None
    if (forced := _forced()) is not None:
        return _cpu_backend[0].primitives() if forced.backend == "cpu" else None
    if uses_gpu():
        return None
    return _cpu_backend[0].primitives()


@lru_cache(maxsize=1)
def _default_kernels() -> MetalKernels:
    return MetalKernels()  # kernel objects are built on first use and kept


def _metal() -> MetalKernels | None:
    """The kernels to use, or None for the fallback."""
    forced = _forced()
    if forced is not None:
        if forced.backend != "metal":
            return None
    elif not uses_gpu():  # (kernel_backend() says why; this runs once per layer)
        return None
    if forced is not None and forced.kernels is not None:
        return forced.kernels
    return _default_kernels()


@contextmanager
def force_backend(
    backend: str,
    factory: KernelFactory | None = None,
    config: MetalConfig | None = None,
    self_test: str | None = None,
) -> Iterator[MetalKernels | None]:
    """Use `backend` ("metal", "fallback" or "cpu": mlxserve's CPU primitives) inside the
    block, whatever the machine has.

    For tests and for exporting graphs: `factory` replaces mx.fast.metal_kernel (e.g. the
    emulator in metal/checker). Forcing "metal" where Metal cannot run still builds the
    graph (mx.export_function records it), but evaluating it raises. `self_test`
    ("fallback" or "raise", see ops/selftest.py) verifies each kernel variant on first use;
    None (the default here) trusts them.
    """
    if backend not in ("metal", "fallback", "cpu"):
        raise ValueError(f"backend must be 'metal', 'fallback' or 'cpu', got {backend!r}")
    if self_test not in (None, *selftest.MODES):
        raise ValueError(f"self_test must be None or one of {selftest.MODES}, got {self_test!r}")
    kernels = None
    if backend == "metal" and (factory is not None or config is not None):
        kernels = MetalKernels(factory, config)
    token = _override.push(_Override(backend, kernels, self_test))
    try:
        yield kernels or (_default_kernels() if backend == "metal" else None)
    finally:
        _override.pop(token)


def write_kv(
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_head_dim)
    v_cache: mx.array,
    keys: mx.array,  # (num_tokens, num_kv_heads, k_head_dim)
    values: mx.array,
    slot_mapping: mx.array,  # (num_tokens,) int32
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V rows into the pool; returns the updated (k_cache, v_cache).

    MLX's scatter, in place when the old pools can be donated: the pools passed in are
    consumed, keep only the returned ones. 8-bit pools get their rows quantized first (on
    Metal by the quantize_kv kernel once it passed its self-test).
    """
    kernels = _metal()
    if kernels is None and (module := cpu_module()) is not None:
        return _cpu_backend[0].write_kv(module, k_cache, v_cache, keys, values, slot_mapping)
    if kernels is None or not kv_quant.is_quantized(k_cache) or keys.shape != values.shape:
        return fallback.write_kv(k_cache, v_cache, keys, values, slot_mapping)
    if not selftest.quantize_ok(kernels, keys.dtype, keys.shape[-1], _self_test_mode()):
        return fallback.write_kv(k_cache, v_cache, keys, values, slot_mapping)
    k_rows, v_rows = kernels.quantize_kv(keys, values)
    return fallback.scatter_rows(k_cache, v_cache, k_rows, v_rows, slot_mapping)


def _kernels_for(q: mx.array, k_cache: mx.array, v_cache: mx.array) -> MetalKernels | None:
    """The Metal kernels when they are in use and handle these shapes, else None (fallback)."""
    kernels = _metal()
    if kernels is None:
        return None
    reason = unsupported_reason(q, k_cache, v_cache)
    if reason is not None:
        _note_fallback(reason)
        return None
    return kernels


@cache
def _note_fallback(reason: str) -> None:
    logger.info("paged attention: %s; these layers use the fallback", reason)


def paged_attention(
    q: mx.array,  # (num_tokens, num_heads, k_head_dim)
    k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, k_head_dim)
    v_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, v_head_dim)
    md: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:  # (num_tokens, num_heads, v_head_dim)
    """Attention of each new token over its request's context in the block pool.

    ``window``: a query at position p sees keys in (p - window, p] (sliding window).
    ``sinks``: (num_heads,) logits that join each head's softmax denominator (gpt-oss).
    """
    _check_window(window)
    kernels = _kernels_for(q, k_cache, v_cache)
    if kernels is None and (module := cpu_module()) is not None:
        backend = _cpu_backend[0]
        return backend.paged_attention(module, q, k_cache, v_cache, md, scale, window, sinks)
    mode = _self_test_mode()
    if kernels is None or not selftest.attention_ok(kernels, q, k_cache, md, window, sinks, mode):
        return fallback.paged_attention(q, k_cache, v_cache, md, scale, window, sinks)
    return kernels.paged_attention(q, k_cache, v_cache, md, scale, window=window, sinks=sinks)


def _self_test_mode() -> str | None:
    """How kernel variants are verified: on Metal by machine choice ("auto"), fall back."""
    forced = _forced()
    return forced.self_test if forced is not None else "fallback"


def metal_kernels() -> MetalKernels | None:
    """The Metal kernels the ops use right now, or None when they use the fallback."""
    return _metal()


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"attention window must be >= 1 token, got {window}")
