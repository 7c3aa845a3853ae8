"""Metal kernels for paged attention and 8-bit row quantization, via mx.fast.metal_kernel.

Kernel bodies live in ``metal/*.metal`` (shipped as ``mlxserve._metal``). ``MetalKernels``
builds each kernel object once, from a factory with mx.fast.metal_kernel's signature: the real
one on a Mac, the CPU emulator of ``metal/checker`` in Linux tests.

The pool write is MLX's scatter, on Metal as on the CPU
-------------------------------------------------------
``ops.write_kv`` puts the new K/V rows into the pools with MLX's own scatter (what mlx-lm's
KV cache does with a slice update). Its output *is* the new pool, so MLX's graph orders every
later reader after the write -- the attention kernels here, and anything else: the next
step's write, pool growth by ``mx.concatenate`` -- and the Metal encoder sees the pool as the
scatter's output buffer (a barrier within an encoder, a fence across encoders).

It is in place whenever the old pool can be donated. MLX 0.32's ``Scatter::eval_gpu`` (like
``eval_cpu``) first copies its input into its output with ``copy_gpu(in, out, Vector)`` for a
row-contiguous input, and ``set_copy_output_data`` (backend/common/copy.h) then hands the
input's buffer to the output instead of allocating, when ``is_donatable(in, out)``: no other
array references the input or shares its buffer (both use counts 1), the item sizes match
and the buffer is at most 16 KiB larger than the output. The reshapes around the scatter
share the buffer and are released before it runs. Two consequences:

* The caller must drop its old pool arrays before the step is evaluated (KVCache keeps one
  reference, which the layer replaces; the runner lets go of its saved copy first).
* MLX also keeps each kernel's input buffers until that kernel has *finished* (cpu/eval.cpp,
  metal/eval.cpp: released when the task or command buffer completes), so the write is in
  place only if the pool's previous readers are done. Between steps they are: the runner
  waits for a step's results before it builds the next, and each step writes each pool
  once. A second write of a pool within one evaluation may copy it instead (a step re-run
  in parts after a failure; on Metal possibly the draft model's passes) -- correct, slower.

The engine warns once if a step copied a pool (worker/pool_watch.py). Contiguity does not
decide correctness (the attention kernels get a row-contiguous copy of anything else): a
non-row-contiguous pool costs one copy, as the scatter's output is row-contiguous, and the
pools come from mx.zeros, mx.concatenate and the scatter, all row-contiguous (the engine
test checks each step's pools).

Why not a kernel that writes the pool: mx.fast.metal_kernel gives every output a fresh
buffer (no donation or aliasing in MLX 0.32), so a kernel that *outputs* the pool copies it
per layer and step, and one that writes it through a ``const`` input (this module's earlier
design) is outside MLX's contract and invisible to its dependency tracking: only the kernels
that took its ordering token waited for it. A C++ extension primitive whose output aliases
the pool (vllm-metal's paged_ops.cpp) would also be sound, but needs an extension built
against each user's MLX on every Mac, and its Metal half can be neither compiled nor run
where this project is tested. The scatter's price: two dispatches per layer (K and V;
independent, no barrier between them) where the fused write had one; 8-bit pools add one
``quantize_kv`` launch (K and V rows into fresh, small outputs) before them.

Pools must have at least 8 elements (smaller inputs are bound as ``constant``).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxserve.ops import kv_quant
from mlxserve.ops.metadata import AttentionMetadata
from mlxserve.ops.metal_config import (
    HEADER_FILE,
    KERNELS,
    MIN_DEVICE_ELEMENTS,
    PATH_KERNELS,
    TILED_ROWS,
    TILED_SIMDGROUPS,
    MetalConfig,
    gpu_cores,
    head_groups,
    prefill_tile_tokens,
)

KernelFactory = Callable[..., Callable[..., list[mx.array]]]

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_HEAD_DIM = 256


def kernel_dir() -> Path:
    """Where the .metal files are: the source tree this package sits in, else the package data.

    The source tree comes first: an editable install elsewhere maps ``mlxserve._metal`` to
    *its* checkout, which would pair this code with another tree's kernels.
    """
    source = Path(__file__).resolve().parents[2] / "metal"
    if (source / HEADER_FILE).is_file():
        return source
    return Path(str(importlib.resources.files("mlxserve._metal")))


def read_source(file: str) -> str:
    """Text of one kernel file."""
    return (kernel_dir() / file).read_text()


class MetalKernels:
    """mlxserve's Metal kernels, each built once from `factory` (mx.fast.metal_kernel)."""

    def __init__(self, factory: KernelFactory | None = None, config: MetalConfig | None = None):
        self.factory = factory or mx.fast.metal_kernel
        self.config = config or MetalConfig()
        if self.config.gpu_cores is None:
            self.gpu_cores, self.gpu_cores_source = gpu_cores()
        else:
            self.gpu_cores, self.gpu_cores_source = self.config.gpu_cores, "configured"
        self._kernels: dict[str, Callable[..., list[mx.array]]] = {}
        self._constants: dict[tuple, mx.array] = {}
        self.self_tests: dict[str, object] = {}  # variant -> ops.selftest.SelfTestResult
        self._bound: dict[str, tuple[object, tuple]] = {}  # padded metadata, by kind
        self.disabled: set[str] = set()  # kernels replaced after a failed self-test

    def kernel(self, name: str) -> Callable[..., list[mx.array]]:
        """The kernel object for `name`, built on first use."""
        if name not in self._kernels:
            file, inputs, outputs = KERNELS[name]
            self._kernels[name] = self.factory(
                name=name,
                input_names=inputs,
                output_names=outputs,
                source=read_source(file),
                header=read_source(HEADER_FILE),
            )
        return self._kernels[name]

    def _constant(self, value, dtype: mx.Dtype, vector: bool = False) -> mx.array:
        # Built from Python data, so already materialized: safe to reuse across graphs,
        # mx.compile and export traces (a lazy mx.full made inside a trace would not be).
        key = (value, str(dtype), vector)
        if key not in self._constants:
            self._constants[key] = mx.array([value] if vector else value, dtype=dtype)
        return self._constants[key]

    def _device_bound(self, kind: str, key: object, make: Callable[[], tuple]) -> tuple:
        """make()'s padded inputs, reused while `key` (the step's metadata, shared by every
        layer) is the same object: one pad per step, not per layer."""
        last = self._bound.get(kind)
        if last is None or last[0] is not key:
            last = self._bound[kind] = (key, make())
        return last[1]

    # ---- 8-bit rows --------------------------------------------------------------------
    def quantize_kv(
        self,
        keys: mx.array,  # (num_tokens, num_kv_heads, head_dim)
        values: mx.array,  # (num_tokens, num_kv_heads, head_dim)
    ) -> tuple[mx.array, mx.array]:  # 2 x (num_tokens, num_kv_heads, head_dim + 4) int8
        """K and V as 8-bit pool rows with their scales (ops/kv_quant.py's format), in fresh
        arrays: what ops.write_kv scatters into 8-bit pools."""
        num_tokens, num_kv_heads, head_dim = keys.shape
        if values.shape != keys.shape:
            raise ValueError(f"quantize_kv: keys {keys.shape} and values {values.shape} differ")
        row_shape = (num_tokens, num_kv_heads, head_dim + kv_quant.KV_SCALE_BYTES)
        k_rows, v_rows = self.kernel("quantize_kv")(
            inputs=[keys, values.astype(keys.dtype)],
            output_shapes=[row_shape, row_shape],
            output_dtypes=[kv_quant.QUANT_DTYPE, kv_quant.QUANT_DTYPE],
            grid=(32 * num_kv_heads, num_tokens, 1),
            threadgroup=(32, 1, 1),
            template=[("T", keys.dtype), ("HEAD_DIM", head_dim)],
        )
        return k_rows, v_rows

    # ---- attention --------------------------------------------------------------------
    def paged_attention(
        self,
        q: mx.array,  # (num_tokens, num_heads, head_dim)
        k_cache: mx.array,  # (num_blocks, block_size, num_kv_heads, head_dim)
        v_cache: mx.array,
        md: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,  # (num_heads,)
        paths: tuple[str, ...] | None = None,
    ) -> mx.array:  # (num_tokens, num_heads, head_dim)
        """Decode-only batches use the decode kernel (split-K for few long contexts), mixed
        ones the varlen prefill kernel (its decodes split-K'd too when that pays). `window`
        and `sinks` as in ops.paged_attention. `paths` forces attention_paths()'s choice (the
        self-test)."""
        _check_pool(k_cache, v_cache)
        reason = unsupported_reason(q, k_cache, v_cache)
        if reason is not None:
            raise ValueError(f"Metal paged attention: {reason}")
        num_tokens, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out_dtype = q.dtype
        quant = kv_quant.is_quantized(k_cache)  # 8-bit pools: T is q's dtype
        if not quant and q.dtype != k_cache.dtype:
            q = q.astype(k_cache.dtype)
        dtype = q.dtype
        gqa = num_heads // num_kv_heads
        num_simd = max(self.config.num_simd, -(-head_dim // 32))
        scale_arr = self._constant(float(scale), mx.float32)
        use_sinks = sinks is not None
        if sinks is None:  # never read (USE_SINKS false); one element, bound as constant
            sinks = self._constant(0.0, mx.float32, vector=True)
        elif sinks.dtype != mx.float32:
            sinks = sinks.astype(mx.float32)
        block_tables, context_lens, query_start_loc = self._device_bound(
            "md", md, lambda: _metadata_inputs(md)
        )
        common = [q, k_cache, v_cache, block_tables, context_lens]
        base = [
            ("T", dtype),
            ("HEAD_DIM", head_dim),
            ("BLOCK_SIZE", block_size),
            ("GQA", gqa),
            ("NUM_SIMD", num_simd),
            ("WINDOW", window or 0),
            ("KV_QUANT", quant),
        ]
        threads = num_simd * 32
        width = threads * num_kv_heads * head_groups(gqa)[0]  # grid x: one per head group
        paths = paths or self.attention_paths(md, num_kv_heads, gqa, window)
        split = "split" in paths
        decoded = None
        if split:  # the decodes (rows 0 .. num_decodes - 1), or every row of a decode batch
            rows = md.num_decodes if "prefill" in paths else num_tokens
            decoded = self._split_decode(common, scale_arr, sinks, use_sinks, base, md, rows)
        elif "decode" in paths:
            (decoded,) = self.kernel("paged_decode")(
                inputs=[*common, scale_arr, sinks],
                output_shapes=[q.shape],
                output_dtypes=[dtype],
                grid=(width, num_tokens, 1),
                threadgroup=(threads, 1, 1),
                template=[*base, ("USE_SINKS", use_sinks)],
            )
        if "prefill" not in paths:
            out = decoded
        else:
            name = self.prefill_kernel(head_dim)
            tq = prefill_tile_tokens(gqa, tiled=name == "paged_prefill_tiled")
            req_begin = md.num_decodes if split else 0
            num_tiles = md.num_reqs - req_begin + -(-num_tokens // tq) + 1
            template = [*base, ("USE_SINKS", use_sinks), ("TQ", tq)]
            if name == "paged_prefill_tiled":  # 4 simdgroups of 8 rows, 32-row tiles
                threads = TILED_SIMDGROUPS * 32
                width = threads * num_kv_heads * head_groups(gqa, TILED_ROWS)[0]
                template = [kv for kv in template if kv[0] != "NUM_SIMD"]
            (out,) = self.kernel(name)(
                inputs=[
                    *common,
                    query_start_loc,
                    self._constant(req_begin, mx.int32),
                    scale_arr,
                    sinks,
                ],
                output_shapes=[q.shape],
                output_dtypes=[dtype],
                grid=(width, num_tiles, 1),
                threadgroup=(threads, 1, 1),
                template=template,
            )
            if split and md.num_decodes:  # decode rows from split-K, the rest from prefill
                out = mx.concatenate([decoded, out[md.num_decodes :]])
        return out if out.dtype == out_dtype else out.astype(out_dtype)

    def prefill_kernel(self, head_dim: int) -> str:
        """The varlen prefill kernel in use: the simdgroup-matrix one (config.prefill
        "tiled", head_dim a multiple of 8, not disabled by a failed self-test), else the
        SIMT one."""
        tiled = self.config.prefill == "tiled" and "paged_prefill_tiled" not in self.disabled
        return "paged_prefill_tiled" if tiled and head_dim % 8 == 0 else "paged_prefill"

    def attention_paths(
        self, md: AttentionMetadata, num_kv_heads: int, gqa: int, window: int | None
    ) -> tuple[str, ...]:
        """Which of PATH_KERNELS attend this batch: the prefill kernel for batches with
        prefill chunks, split-K for decodes too few to fill the GPU over long contexts (in
        mixed batches as well), else the decode kernel."""
        split = self.split_decodes(md, num_kv_heads, gqa, window)
        if md.num_decodes < md.num_reqs:
            return ("split", "prefill") if split else ("prefill",)
        return ("split",) if split else ("decode",)

    def split_decodes(
        self, md: AttentionMetadata, num_kv_heads: int, gqa: int, window: int | None
    ) -> bool:
        """Whether this batch's decodes take split-K: their threadgroups number fewer than
        groups_per_core per GPU core and the longest attended context is long enough."""
        if md.num_decodes == 0:
            return False
        cfg = self.config
        attended = min(md.max_decode_context_len, window or md.max_decode_context_len)
        groups = md.num_decodes * num_kv_heads * head_groups(gqa)[0]
        target = self.gpu_cores * cfg.groups_per_core
        return groups < target and attended >= cfg.split_min_context

    def attention_variant(
        self,
        path: str,
        dtype: mx.Dtype,
        head_dim: int,
        block_size: int,
        gqa: int,
        window: int | None,
        use_sinks: bool,
        kv_quant: bool = False,
    ) -> str:
        """The kernel(s) and template arguments `path` launches for these shapes, as text:
        what the self-test verifies once (ops/selftest.py) and what its warning names.
        `dtype` is q's; `kv_quant` says the pools are 8-bit (ops/kv_quant.py)."""
        num_simd = max(self.config.num_simd, -(-head_dim // 32))
        kernel = PATH_KERNELS[path]
        tiled = path == "prefill" and self.prefill_kernel(head_dim) == "paged_prefill_tiled"
        args = [
            f"T={_dtype_name(dtype)}",
            f"HEAD_DIM={head_dim}",
            f"BLOCK_SIZE={block_size}",
            f"GQA={gqa}",
            f"NUM_SIMD={num_simd}",
            f"WINDOW={window or 0}",
            f"USE_SINKS={str(use_sinks).lower()}",
            f"KV_QUANT={str(kv_quant).lower()}",
        ]
        if tiled:
            kernel = "paged_prefill_tiled"
            args.remove(f"NUM_SIMD={num_simd}")
        if path == "prefill":
            args.append(f"TQ={prefill_tile_tokens(gqa, tiled=tiled)}")
        if path == "split":
            args.append(f"PARTITION_SIZE={self.config.partition_size}")
        return f"{kernel}<{', '.join(args)}>"

    def _split_decode(self, common, scale_arr, sinks, use_sinks, base, md, rows) -> mx.array:
        """Split-K decode attention of q's first `rows` rows: (rows, num_heads, head_dim)."""
        q = common[0]
        _, num_heads, head_dim = q.shape
        num_kv_heads = common[1].shape[2]
        gqa = num_heads // num_kv_heads
        threads = base[4][1] * 32
        part = self.config.partition_size
        # Partitions: enough for the longest context, rounded up to a power of two so the
        # partial buffers keep their shape while contexts grow.
        num_parts = 1 << max(0, (-(-md.max_decode_context_len // part) - 1).bit_length())
        # Unused rows keep the partials >= 8 elements: the reduce binds them as `device`.
        buf_rows = max(rows, -(-MIN_DEVICE_ELEMENTS // (num_heads * num_parts)))
        partial_out, partial_max, partial_sum = self.kernel("paged_decode_split")(
            inputs=[*common, scale_arr],
            output_shapes=[
                (buf_rows, num_heads, num_parts, head_dim),
                (buf_rows, num_heads, num_parts),
                (buf_rows, num_heads, num_parts),
            ],
            output_dtypes=[mx.float32, mx.float32, mx.float32],
            grid=(threads * num_kv_heads * head_groups(gqa)[0], rows, num_parts),
            threadgroup=(threads, 1, 1),
            template=[*base, ("PARTITION_SIZE", part)],
        )
        width = -(-head_dim // 32) * 32
        t, dim, window = base[0], base[1], base[5]
        (out,) = self.kernel("paged_decode_reduce")(
            inputs=[partial_out, partial_max, partial_sum, common[4], sinks],
            output_shapes=[(rows, num_heads, head_dim)],
            output_dtypes=[t[1]],
            grid=(width, num_heads, rows),
            threadgroup=(width, 1, 1),
            template=[t, dim, ("PARTITION_SIZE", part), window, ("USE_SINKS", use_sinks)],
        )
        return out


def _at_least_8(a: mx.array, fill: int | None = 0) -> mx.array:
    """`a` (1-D) padded to 8 entries with `fill` (None: its last value) if it is shorter."""
    if a.size >= MIN_DEVICE_ELEMENTS:
        return a
    pad = mx.full((MIN_DEVICE_ELEMENTS - a.size,), 0, dtype=a.dtype)
    if fill is None:
        pad = mx.broadcast_to(a[-1:], pad.shape)
    return mx.concatenate([a, pad])


def _metadata_inputs(md: AttentionMetadata) -> tuple[mx.array, mx.array, mx.array]:
    """(block_tables, context_lens, query_start_loc) as the kernels take them: each with
    >= 8 elements, so MLX always binds them as `device` (see MIN_DEVICE_ELEMENTS)."""
    tables = md.block_tables
    num_reqs, width = tables.shape
    if tables.size < MIN_DEVICE_ELEMENTS:  # wider rows of null blocks: width is only a stride
        extra = -(-MIN_DEVICE_ELEMENTS // num_reqs) - width
        tables = mx.concatenate([tables, mx.zeros((num_reqs, extra), dtype=tables.dtype)], 1)
    return tables, _at_least_8(md.context_lens), _at_least_8(md.query_start_loc, fill=None)


def quantize_variant(dtype: mx.Dtype, head_dim: int) -> str:
    """The 8-bit row quantization kernel's variant for new rows of `dtype` and `head_dim`."""
    return f"quantize_kv<T={_dtype_name(dtype)}, HEAD_DIM={head_dim}>"


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def unsupported_reason(q: mx.array, k_cache: mx.array, v_cache: mx.array) -> str | None:
    """Why the kernels cannot attend with these shapes (the dispatcher then uses the
    fallback), or None."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape:
        k_dim, v_dim = kv_quant.pool_head_dim(k_cache), kv_quant.pool_head_dim(v_cache)
        return f"K and V head sizes differ ({k_dim} vs {v_dim})"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is above the kernels' {MAX_HEAD_DIM}"
    if num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    return None


def _check_pool(k_cache: mx.array, v_cache: mx.array) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} "
            f"{v_cache.dtype} must match"
        )
    if k_cache.dtype not in SUPPORTED_DTYPES and not kv_quant.is_quantized(k_cache):
        raise ValueError(
            f"Metal kernels: pool dtype {k_cache.dtype} is not one of float16, bfloat16, "
            "float32, int8 (8-bit rows with scales)"
        )
    if k_cache.size < 8:
        raise ValueError(
            f"Metal kernels: a pool of {k_cache.size} elements is below the 8 "
            "that MLX binds as device memory"
        )
