"""Self-test of each Metal kernel variant on its first use, against the fallback.

The kernels are compiled by Apple's compiler only on the user's machine, so a variant (a
kernel with its template arguments: dtype, head_dim, block size, GQA ratio, window, ...) is
not trusted until it has run once here: the first time the dispatcher is about to use it, it
runs on a small input of the same variant and is compared with the MLX fallback (the pool
write itself is MLX's scatter: nothing to test). A compile or launch error or a mismatch is
logged once, with the kernel, the variant and the MLX and OS versions, and that op uses the
fallback from then on. Mode "raise" (``kernels='metal'``, for CI) raises instead.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np

from mlxserve.ops import fallback, kv_quant
from mlxserve.ops.metadata import AttentionMetadata
from mlxserve.ops.metal import PATH_KERNELS, MetalKernels, quantize_variant

TILED, SIMT = "paged_prefill_tiled", "paged_prefill"

logger = logging.getLogger("mlxserve")

MODES = ("fallback", "raise")
# Kernel vs fallback, both in the pool dtype; an injected or real bug is far outside these.
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 6e-2}
MAX_WINDOW_CONTEXT = 8192  # longer windows are tested without reaching their edge


class KernelSelfTestError(RuntimeError):
    """A Metal kernel variant failed its self-test while kernels='metal' was forced."""


@dataclass(frozen=True)
class SelfTestResult:
    """Outcome of one variant's self-test; `detail` says what went wrong ("" when ok)."""

    variant: str
    ok: bool
    detail: str = ""


def platform_versions() -> str:
    """MLX and OS versions, as a warning or `mlxserve doctor` names them."""
    mac = platform.mac_ver()[0]
    system = f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"
    return f"MLX {mx.__version__}, {system}"


def attention_ok(
    kernels: MetalKernels,
    q: mx.array,
    k_cache: mx.array,
    md: AttentionMetadata,
    window: int | None,
    sinks: mx.array | None,
    mode: str | None,
) -> bool:
    """Whether the attention variant this batch would launch passed its self-test (run now
    on first use). mode None skips the test (explicit factories: tests, exports)."""
    if mode is None:
        return True
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim = q.shape[2]
    gqa = q.shape[1] // num_kv_heads
    use_sinks = sinks is not None
    quant = kv_quant.is_quantized(k_cache)  # 8-bit pools: the variant is q's dtype + KV_QUANT
    dtype = q.dtype if quant else k_cache.dtype
    for path in kernels.attention_paths(md, num_kv_heads, gqa, window):
        results = _verify_path(
            kernels, path, dtype, head_dim, block_size, gqa, window, use_sinks, mode, quant
        )
        if not results[-1].ok:
            return False
    return True


def _verify_path(
    kernels: MetalKernels,
    path: str,
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    gqa: int,
    window: int | None,
    use_sinks: bool,
    mode: str,
    quant: bool = False,
) -> list[SelfTestResult]:
    """Self-test (or recall) the variant `path` launches; a failed tiled prefill is
    disabled and the SIMT prefill tested in its place. The results, the one in use last."""
    test = partial(
        _test_attention, kernels, path, dtype, head_dim, block_size, gqa, window, use_sinks, quant
    )
    results = []
    while True:
        tiled = path == "prefill" and kernels.prefill_kernel(head_dim) == TILED
        variant = kernels.attention_variant(
            path, dtype, head_dim, block_size, gqa, window, use_sinks, quant
        )
        instead = f"the SIMT prefill kernel ({SIMT})" if tiled else "the MLX fallback"
        ok = _verified(kernels, variant, test, mode, instead)
        results.append(kernels.self_tests[variant])
        if ok or not tiled:
            return results
        kernels.disabled.add(TILED)  # prefill_kernel() now picks the SIMT kernel


def quantize_ok(kernels: MetalKernels, dtype: mx.Dtype, head_dim: int, mode: str | None) -> bool:
    """Whether the 8-bit row quantization of `dtype` rows of `head_dim` passed its
    self-test (run on first use)."""
    if mode is None:
        return True
    variant = quantize_variant(dtype, head_dim)
    return _verified(kernels, variant, lambda: _test_quantize(kernels, dtype, head_dim), mode)


def run_all(
    kernels: MetalKernels,
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    gqa: int,
    window: int | None = None,
    use_sinks: bool = False,
    quant: bool = False,
) -> list[SelfTestResult]:
    """Self-test (or recall) every variant a model of these shapes uses: each attention
    path, the SIMT prefill where the tiled one failed, and with `quant` (8-bit pools,
    kv_cache_dtype int8) the row quantization first (``mlxserve doctor``). Failures are
    logged as on first use."""
    results = []
    if quant:
        quantize_ok(kernels, dtype, head_dim, "fallback")
        results.append(kernels.self_tests[quantize_variant(dtype, head_dim)])
    for path in PATH_KERNELS:
        results += _verify_path(
            kernels, path, dtype, head_dim, block_size, gqa, window, use_sinks, "fallback", quant
        )
    return results


def _verified(
    kernels: MetalKernels,
    variant: str,
    test: Callable[[], str],
    mode: str,
    instead: str = "the MLX fallback",
) -> bool:
    result = kernels.self_tests.get(variant)
    if result is None:
        try:
            detail = test()
        except Exception as e:  # noqa: BLE001 -- any failure to build, compile or run
            detail = f"compile or launch error: {type(e).__name__}: {_first_line(e)}"
        result = SelfTestResult(variant, not detail, detail)
        kernels.self_tests[variant] = result
        if not result.ok and mode == "fallback":
            logger.warning(
                "Metal kernel %s failed its self-test (%s) with %s; this op uses %s from "
                "now on (slower, same results). Please report this.",
                variant,
                detail,
                platform_versions(),
                instead,
            )
    if not result.ok and mode == "raise":
        raise KernelSelfTestError(
            f"Metal kernel {variant} failed its self-test ({result.detail}) with "
            f"{platform_versions()}; kernels='metal' (MLXSERVE_KERNELS) allows no fallback"
        )
    return result.ok


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _dtype_key(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _test_quantize(kernels: MetalKernels, dtype: mx.Dtype, head_dim: int) -> str:
    """Quantize 4 tokens x 2 heads of K and V (V = 3 K, and one all-zero row): each row must
    dequantize to the fallback's within one step (a division may round differently on the
    GPU), with the same scale."""
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((4, 2, head_dim)).astype(np.float32)).astype(dtype)
    keys[1, 0] = 0  # the all-zero row: zeros and scale 0
    values = keys * 3
    mx.eval(keys, values)
    got = kernels.quantize_kv(keys, values)
    mx.eval(got)
    for name, rows, new in zip(("k_rows", "v_rows"), got, (keys, values), strict=True):
        want = kv_quant.quantize(new)
        if rows.shape != want.shape or rows.dtype != want.dtype:
            return f"mismatch: {name} is {rows.shape} {rows.dtype}, not {want.shape} {want.dtype}"
        (_, got_scale), (_, step) = kv_quant.split(rows), kv_quant.split(want)
        got_scale, step = np.array(got_scale), np.array(step)
        if not np.allclose(got_scale, step, rtol=1e-6, atol=0):
            return f"mismatch: {name} scales differ from the fallback's"
        deq = [np.array(kv_quant.dequantize(r, mx.float32)) for r in (rows, want)]
        if not np.all(np.abs(deq[0] - deq[1]) <= 1.01 * step[..., None]):
            return f"mismatch: {name} values differ from the fallback's quantization"
    return ""


def _test_attention(
    kernels: MetalKernels,
    path: str,
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    gqa: int,
    window: int | None,
    use_sinks: bool,
    quant: bool = False,
) -> str:
    """Attend a small batch on `path` with the kernels and with the fallback; compare
    (`quant`: over 8-bit pools, which both dequantize)."""
    rng = np.random.default_rng(1)
    num_kv_heads = 2
    long = 2 * block_size + 3
    if window and window + 2 <= MAX_WINDOW_CONTEXT:
        long = max(long, window + 2)  # reach past the window's edge
    if path == "prefill":  # a decode, and a chunk that crosses a block edge after a prefix
        requests = [(1, block_size + 2), (min(5, long), long)]
    else:
        requests = [(1, block_size + 2), (1, long)]
    query_lens = [q for q, _ in requests]
    context_lens = [c for _, c in requests]
    tables, next_block = [], 1
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # not in order
        next_block += n
    md = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    pool_shape = (next_block, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (
        mx.array(rng.standard_normal(pool_shape).astype(np.float32)).astype(dtype) for _ in range(2)
    )
    if quant:
        k_cache, v_cache = kv_quant.quantize(k_cache), kv_quant.quantize(v_cache)
    num_heads = gqa * num_kv_heads
    q = mx.array(rng.standard_normal((sum(query_lens), num_heads, head_dim)).astype(np.float32))
    q = q.astype(dtype)
    sinks = mx.array(rng.standard_normal(num_heads).astype(np.float32)) if use_sinks else None
    scale = head_dim**-0.5
    mx.eval(k_cache, v_cache, q)
    want = fallback.paged_attention(q, k_cache, v_cache, md, scale, window, sinks)
    got = kernels.paged_attention(q, k_cache, v_cache, md, scale, window, sinks, paths=(path,))
    mx.eval(want, got)
    want = np.array(want.astype(mx.float32))
    got = np.array(got.astype(mx.float32))
    tol = TOLERANCE[_dtype_key(dtype)]
    if not np.all(np.isfinite(got)):
        return "mismatch: non-finite output"
    if not np.allclose(got, want, atol=tol, rtol=tol):
        err = float(np.max(np.abs(got - want)))
        return f"mismatch: max abs error {err:.3g} vs the fallback (tolerance {tol:g})"
    return ""
