"""Self-test of each Metal kernel variant on its first use, against the fallback.

The kernels are compiled by Apple's compiler only on the user's machine, so a variant (a
kernel with its template arguments: dtype, head_dim, block size, GQA ratio, window, ...) is
not trusted until it has run once here: the first time the dispatcher is about to use it, it
runs on a small input of the same variant and is compared with the MLX fallback; the pool
write is read back slot by slot. A compile or launch error, a mismatch or a lost write is
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
from mlxserve.ops.metal import PATH_KERNELS, MetalKernels, write_variant

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


def write_ok(
    kernels: MetalKernels, dtype: mx.Dtype, mode: str | None, quant_head_dim: int | None = None
) -> bool:
    """Whether the in-place pool write for `dtype` passed its self-test (run on first use);
    with `quant_head_dim`, the quantizing write of `dtype` rows of that size (8-bit pools)."""
    if mode is None:
        return True
    variant = write_variant(dtype, quant_head_dim)
    return _verified(kernels, variant, lambda: _test_write(kernels, dtype, quant_head_dim), mode)


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
    """Self-test (or recall) every variant a model of these shapes uses: the write and each
    attention path, and the SIMT prefill where the tiled one failed (``mlxserve doctor``).
    `quant`: over 8-bit pools (kv_cache_dtype int8). Failures are logged as on first use."""
    quant_head_dim = head_dim if quant else None
    write = write_variant(dtype, quant_head_dim)
    _verified(kernels, write, lambda: _test_write(kernels, dtype, quant_head_dim), "fallback")
    results = [kernels.self_tests[write]]
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


def _test_write(kernels: MetalKernels, dtype: mx.Dtype, quant_head_dim: int | None = None) -> str:
    """Write 4 rows into a 4-block pool; every slot must read back as written or untouched."""
    if quant_head_dim is not None:
        return _test_quantized_write(kernels, dtype, quant_head_dim)
    rng = np.random.default_rng(0)
    shape = (4, 4, 2, 32)  # blocks, block size, kv heads, head_dim
    slots = np.array([5, 6, 13, 2], dtype=np.int32)
    pools = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    rows = [rng.standard_normal((len(slots), *shape[2:])).astype(np.float32) for _ in range(2)]
    k_cache, v_cache = (mx.array(p).astype(dtype) for p in pools)
    mx.eval(k_cache, v_cache)
    before = [np.array(p.astype(mx.float32)) for p in (k_cache, v_cache)]
    keys, values = (mx.array(r).astype(dtype) for r in rows)
    k_new, v_new, token = kernels.write_kv(k_cache, v_cache, keys, values, mx.array(slots))
    mx.eval(k_new, v_new, token)
    for name, got, old, new in zip(
        ("k_cache", "v_cache"), (k_new, v_new), before, (keys, values), strict=True
    ):
        got = np.array(got.astype(mx.float32)).reshape(-1, *shape[2:])
        want = old.reshape(-1, *shape[2:]).copy()
        want[slots] = np.array(new.astype(mx.float32))
        if np.array_equal(got, want):
            continue
        if np.array_equal(got[slots], old.reshape(-1, *shape[2:])[slots]):
            return f"lost write: {name} slots {slots.tolist()} kept their old contents"
        bad = np.unique(np.nonzero((got != want).any(axis=(1, 2)))[0]).tolist()
        return f"mismatch: {name} slots {bad} differ from the rows written"
    return ""


def _test_quantized_write(kernels: MetalKernels, dtype: mx.Dtype, head_dim: int) -> str:
    """The quantizing write: written rows dequantize to the fallback's within one step
    (a division may round differently on the GPU), other slots keep their bytes."""
    rng = np.random.default_rng(0)
    shape = (4, 4, 2, head_dim + kv_quant.KV_SCALE_BYTES)  # an 8-bit pool
    slots = np.array([5, 6, 13, 2], dtype=np.int32)
    before = [rng.integers(-127, 128, shape, dtype=np.int8) for _ in range(2)]
    k_cache, v_cache = (mx.array(p) for p in before)
    rows = [mx.array(rng.standard_normal((4, 2, head_dim)).astype(np.float32)).astype(dtype)]
    rows.append(rows[0] * 3)
    mx.eval(k_cache, v_cache, *rows)
    k_new, v_new, token = kernels.write_kv(k_cache, v_cache, *rows, mx.array(slots))
    mx.eval(k_new, v_new, token)
    for name, got, old, new in zip(
        ("k_cache", "v_cache"), (k_new, v_new), before, rows, strict=True
    ):
        got = np.array(got).reshape(-1, *shape[2:])
        old = old.reshape(-1, *shape[2:])
        others = np.setdiff1d(np.arange(len(got)), slots)
        if not np.array_equal(got[others], old[others]):
            return f"mismatch: {name} wrote slots other than {slots.tolist()}"
        if np.array_equal(got[slots], old[slots]):
            return f"lost write: {name} slots {slots.tolist()} kept their old contents"
        want = kv_quant.quantize(new)
        _, step = kv_quant.split(want)
        deq = [np.array(kv_quant.dequantize(mx.array(r), mx.float32)) for r in (got[slots], want)]
        if not np.all(np.abs(deq[0] - deq[1]) <= 1.01 * np.array(step)[..., None]):
            return f"mismatch: {name} rows differ from the fallback's quantization"
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
