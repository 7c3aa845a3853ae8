"""`mlxserve doctor [MODEL]`: what this machine runs and how — one report to paste in a bug.

Platform and OS, MLX (and whether it is in the supported range), the Metal device (name,
GPU cores, memory, recommended working set), which attention kernels run and each kernel
variant's self-test, the BLAS under MLX's CPU backend, the process settings
(mlxserve.settings: each field, its variable, `*` where it is not the default), and the
memory plan an engine with these flags would start with (the model is loaded as `serve`
would load it). Exit status 1 when a kernel variant failed its self-test, so CI on a Mac
can run it.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
from collections.abc import Callable, Iterator

import mlx.core as mx

from mlxserve import ops, settings
from mlxserve.cli.engine_args import add_engine_args, engine_config
from mlxserve.config import EngineConfig
from mlxserve.cpu import kernels as cpu_kernels
from mlxserve.cpu.blas import FIX as BLAS_FIX
from mlxserve.cpu.blas import blas_status, fast_blas
from mlxserve.ops import selftest
from mlxserve.ops.metal import MAX_HEAD_DIM, MetalKernels
from mlxserve.utils import GiB, gpu_core_count, usable_memory

# The MLX range pyproject.toml pins (tests/test_mlx_floor.py keeps them equal).
MLX_FLOOR = (0, 32, 3)
MLX_CEILING = (0, 33)
OPENBLAS_HINT = f"for ~10x faster float32 matmuls: {BLAS_FIX}; mlxserve binds it at start-up"


def add_doctor_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check this machine: MLX, Metal, kernels, BLAS, memory plan",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="model for the memory plan (default: embedded)"
    )
    add_engine_args(parser)
    parser.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    """Print the report; exit status 1 when a kernel variant failed its self-test (CI)."""
    config = engine_config(args, args.model or args.model_flag)
    failed = False
    for line in report(config):
        print(line, flush=True)  # line by line: the system facts show before the model loads
        failed |= line.startswith("self-test:") and ": FAILED" in line
    return 1 if failed else 0


def report(config: EngineConfig) -> Iterator[str]:
    """The report's lines, system facts first; loading the model comes last."""
    process = settings.start()  # validated, and the BLAS bound, as `serve` starts
    yield f"platform:   {platform.platform()} ({platform.machine()}, Python {_python()})"
    yield f"os:         {os_version()}"
    yield f"mlx:        {mlx_line(mx.__version__)}"
    yield f"metal:      {metal_line(mx.metal.is_available(), _device_info, gpu_core_count)}"
    backend, reason = ops.kernel_backend()
    yield f"kernels:    {backend} ({reason}); setting kernels={config.kernels!r}"
    yield f"blas:       {blas_line(sys.platform, fast_blas(), blas_status())}"
    yield f"settings:   {', '.join(settings.describe(process))}"
    if not mx.metal.is_available():  # quantized layers on the CPU run these (or say why not)
        yield f"cpu-qmm:    {cpu_kernels.status()}"
    yield from model_lines(config)


def _python() -> str:
    return platform.python_version()


def os_version() -> str:
    """macOS's product version, else the kernel's name and release."""
    mac = platform.mac_ver()[0]
    return f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def mlx_line(version: str) -> str:
    """MLX's version and whether mlxserve supports it."""
    supported = f">={'.'.join(map(str, MLX_FLOOR))},<{'.'.join(map(str, MLX_CEILING))}"
    v = _parse(version)
    if v < MLX_FLOOR:
        verdict = (
            f"TOO OLD: mlxserve needs {supported} (older MLX misloads Q4_1 GGUF weights "
            "or cannot run mlxserve's CPU kernels)"
        )
    elif v[:2] >= MLX_CEILING:
        verdict = f"newer than tested ({supported}): please report problems"
    else:
        verdict = f"supported ({supported})"
    return f"{version} — {verdict}"


def _device_info() -> dict:
    return dict(mx.device_info())


def metal_line(
    available: bool, device_info: Callable[[], dict], cores: Callable[[], int | None]
) -> str:
    """The Metal device, or why there is none."""
    if not available:
        return "not available (mx.metal.is_available() is False): MLX runs on its CPU backend"
    info = device_info()
    n = cores()
    parts = [
        f"{info.get('device_name', '?')} ({info.get('architecture', '?')})",
        f"{n} GPU cores" if n else "GPU cores unknown",
        f"memory {info.get('memory_size', 0) / GiB:.1f} GiB",
        f"recommended working set {info.get('max_recommended_working_set_size', 0) / GiB:.1f} GiB",
        f"max buffer {info.get('max_buffer_length', 0) / GiB:.1f} GiB",
    ]
    return ", ".join(parts)


def blas_line(platform_name: str, fast: str | None, status: str) -> str:
    """The BLAS MLX's CPU backend uses, and how to get OpenBLAS on Linux when it is missing."""
    if platform_name == "darwin":
        return "Accelerate (MLX on macOS); model ops run on Metal"
    if fast:
        return status
    return f"MLX's bundled reference BLAS ({status}); {OPENBLAS_HINT}"


def kernel_lines(
    kernels: MetalKernels | None,
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    gqa: int,
    kv_quant: bool = False,
    window: int | None = None,
) -> list[str]:
    """Each kernel variant this model uses with its self-test result (running the tests not
    run yet), or why none ran. `kv_quant`: the pools are 8-bit (kv_cache_dtype int8)."""
    if kernels is None:
        return ["self-tests: not run (the fallback is in use; the kernels need a Metal GPU)"]
    lines = []
    results = selftest.run_all(kernels, dtype, head_dim, block_size, gqa, window, quant=kv_quant)
    for r in results:
        verdict = "ok" if r.ok else f"FAILED, using the fallback: {r.detail}"
        lines.append(f"self-test:  {r.variant}: {verdict}")
    return lines


def attention_shapes(model, heads: int) -> list[tuple[int, int, int, int | None]]:
    """(KV heads, K head_dim, V head_dim, window) of each kind of attention layer the model
    has, in layer order: hybrids mix sliding and global layers or head sizes (Gemma 4)."""
    specs = getattr(model, "cache_specs", None)
    if specs is None:
        return [(model.num_kv_heads, model.head_dim, model.head_dim, None)]
    shapes: list[tuple[int, int, int, int | None]] = []
    for spec in specs:
        shape = (spec.num_kv_heads, spec.k_head_dim, spec.v_head_dim, spec.window)
        if spec.is_attention and shape not in shapes:
            shapes.append(shape)
    return shapes


def model_lines(config: EngineConfig) -> Iterator[str]:
    """The model and the memory plan an engine with `config` starts with."""
    from mlxserve.engine.llm_engine import LLMEngine
    from mlxserve.worker.memory import tree_bytes

    engine = LLMEngine(config)
    loaded, model = engine.loaded, engine.model
    heads = int(loaded.config.get("num_attention_heads") or model.num_kv_heads)
    shapes = attention_shapes(model, heads)
    kv = ", ".join(
        f"{n} KV heads x head_dim {k if k == v else f'{k}/{v} (K/V)'}" for n, k, v, _ in shapes
    )
    yield (
        f"model:      {loaded.source.name} ({loaded.source.path}); dtype "
        f"{str(loaded.dtype).removeprefix('mlx.core.')}; {model.num_layers} layers, {heads} "
        f"heads, {kv or 'no attention layers'}; weights "
        f"{tree_bytes(model.parameters()) / GiB:.2f} GiB"
    )
    with ops.use_kernels(config.kernels):
        kernels = ops.metal_kernels()
        seen: set[str] = set()
        for num_kv_heads, k_dim, v_dim, window in shapes:
            if k_dim != v_dim or k_dim > MAX_HEAD_DIM or heads % num_kv_heads:
                yield (
                    f"self-test:  none for {num_kv_heads} KV heads x head_dim {k_dim}/{v_dim}: "
                    "the kernels do not take these layers' shapes; they use the MLX fallback"
                )
                continue
            for line in kernel_lines(
                kernels,
                loaded.dtype,
                k_dim,
                config.block_size,
                heads // num_kv_heads,
                kv_quant=config.kv_cache_dtype == "int8",
                window=window,
            ):
                if line not in seen:  # variants shared by several layer shapes: once
                    seen.add(line)
                    yield line
    where = "Metal recommended working set" if mx.metal.is_available() else "system RAM"
    yield (
        f"memory:     {usable_memory() / GiB:.1f} GiB usable ({where}) x memory_fraction "
        f"{config.memory_fraction}"
    )
    yield f"memory:     {engine.plan.describe(config.max_num_seqs, engine.max_num_batched_tokens)}"
