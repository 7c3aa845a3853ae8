"""mlxserve's CPU kernels for quantized matmuls, as an MLX primitive (lazy, in the graph).

MLX's CPU ``quantized_matmul`` runs at ~2 GFLOP/s (far less with 16-bit scales);
without these kernels small models run dequantized to float32, streaming 4-8x more bytes
per token through BLAS. These kernels (csrc/qmm*.c, see qmm.h) read MLX's
affine-quantized weights directly (2, 3, 4, 5, 6 and 8 bits, groups of 32/64/128,
float32, float16 or bfloat16 scales and biases) and dequantize in registers, with
AVX-512 / AVX2 / NEON paths chosen at run time and the work spread over the cores.
Quantized layers then stay quantized in memory. Their fast widths are 4 and 8 bits (whole
vectors read in place, for one row and for many); other widths unpack value by value,
5-30x slower, so :func:`use_kernels` stores 2- and 3-bit layers at 4 bits and 5- and 6-bit
ones at 8 (the same values, scales and biases: exact; GGUF Q5_0/Q5_1/Q5_K tensors, the
common rows of K-quant mixes, and MLX 5-/6-bit checkpoints take more memory, not time).

The MLX extension is compiled on first use (build.py: a C/C++ compiler, Python headers
and nanobind are needed; ``python -m mlxserve.cpu`` builds it ahead) and cached; when it
cannot be built or loaded, one warning says why and everything takes the previous path
(quantized layers dequantized for BLAS, or MLX's quantized_matmul); :func:`status` says
which. The settings are ``mlxserve.settings.Settings``' cpu_* fields, whose defaults are:

    MLXSERVE_CPU_KERNELS=auto (default)  build (once) and use them for quantized layers
    MLXSERVE_CPU_KERNELS=off             never (MLX's quantized_matmul or dequantized)
    MLXSERVE_CPU_THREADS=N               threads per matmul (default: this process's CPUs)
    MLXSERVE_CPU_INT8=auto (default)|on|off  round activations to int8 per block of 32
                                         and use integer dot products (qmm.h), as llama.cpp
                                         does; auto: when this CPU has an integer SIMD path
                                         (not the scalar one); off (or 0): float activations
"""

from __future__ import annotations

import logging
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlxserve import settings
from mlxserve.affine_bits import widen
from mlxserve.cpu import build
from mlxserve.module_changes import Watched

logger = logging.getLogger(__name__)

_state: dict[str, object] = {"module": None, "reason": "not attempted", "path": None}
BITS = (2, 3, 4, 5, 6, 8)  # every affine width MLX quantizes to
# Widths stored wider for the kernels' fast 4- and 8-bit paths (exact, see above).
STORED_BITS = {2: 4, 3: 4, 5: 8, 6: 8}


def _module() -> ModuleType | None:
    """The loaded extension, building and checking it on the first call; None if unusable."""
    if _state["reason"] != "not attempted":
        return _state["module"]  # type: ignore[return-value]
    config = settings.current()
    if not config.cpu_kernels:
        _state["reason"] = "MLXSERVE_CPU_KERNELS=off"
        return None
    try:
        # A warning: the first start waits for the compiler, and should say why.
        path = build.build(log=logger.warning)
        module = build.load(path)
        if config.cpu_threads is not None:
            module.set_threads(config.cpu_threads)
        _check(module)
    except (build.BuildError, OSError, ImportError, TypeError, ValueError, RuntimeError) as e:
        _state["reason"] = f"CPU kernels unavailable: {e}"
        logger.warning("%s; quantized layers use the previous CPU path", _state["reason"])
        return None
    _state.update(module=module, path=str(path), reason=f"CPU kernels loaded ({path})")
    return module


def _check(module: ModuleType) -> None:
    """A small problem against mx.dequantize + matmul; raises if the extension disagrees."""
    x = mx.arange(3 * 64, dtype=mx.float32).reshape(3, 64) / 50 - 1
    w = mx.sin(mx.arange(5 * 64, dtype=mx.float32)).reshape(5, 64)
    wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
    want = x @ mx.dequantize(wq, scales, biases, group_size=32, bits=4).T
    got = module.quantized_matmul(x, wq, scales, biases, 32, 4)
    if not mx.allclose(got, want, rtol=1e-4, atol=1e-4).item():
        raise RuntimeError("the built extension gives wrong results")


def module() -> ModuleType | None:
    """The loaded extension (its primitives: mlxserve/cpu/ops.py uses them), or None."""
    return _module()


def available() -> bool:
    """Whether the kernels can be used here (builds them on the first call)."""
    return _module() is not None


def int8_activations() -> bool:
    """Whether quantized layers round activations to int8 (``Settings.cpu_int8``)."""
    module = _module()
    if module is None:
        return False
    setting = settings.current().cpu_int8
    if setting != "auto":
        return setting == "on"
    return module.q8_isa() != "scalar"  # the portable integer path is slower than float's


def status() -> str:
    """One line: the kernels in use (instruction sets, threads) or why not."""
    module = _module()
    if module is None:
        return str(_state["reason"])
    acts = f"int8 activations ({module.q8_isa()})" if int8_activations() else "float activations"
    return f"CPU kernels: {module.isa()}, {acts}, {module.threads()} threads ({_state['path']})"


def info() -> dict[str, object]:
    """The kernels' state as data (for ``mlxserve bench`` and a doctor command)."""
    module = _module()
    return {
        "available": module is not None,
        "isa": module.isa() if module else None,
        "int8_isa": module.q8_isa() if module and int8_activations() else None,
        "threads": module.threads() if module else None,
        "path": _state["path"],
        "reason": _state["reason"],
    }


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    act_bits: int = 0,
) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` with the kernels (a lazy mx.array).

    ``act_bits=8``: x rounded to int8 per block of 32 values first (qmm.h says how).
    """
    module = _module()
    if module is None:
        raise RuntimeError(str(_state["reason"]))
    return module.quantized_matmul(x, w, scales, biases, group_size, bits, act_bits)


def force_isa(name: str) -> bool:
    """Use instruction set ``name`` (scalar, avx2, avx512, neon; auto); False if lacking."""
    module = _module()
    return bool(module is not None and module.force_isa(name))


def isa_supported(name: str) -> bool:
    """Whether this CPU and build can run instruction set ``name``."""
    module = _module()
    return bool(module is not None and module.isa_supported(name))


def force_int8_isa(name: str) -> bool:
    """Use int8 instruction set ``name`` (scalar, avx2, avxvnni, avx512vnni, neon; auto)."""
    module = _module()
    return bool(module is not None and module.q8_force_isa(name))


class CpuQuantizedLinear(Watched, nn.QuantizedLinear):
    """nn.QuantizedLinear whose matmul runs in the CPU kernels (its changes counted:
    mlxserve/cpu/stack.py keeps its arrays)."""

    act_bits: int = 0  # 8: activations rounded to int8 (use_kernels decides)

    def __call__(self, x: mx.array) -> mx.array:
        y = _layer_matmul(self, x)
        return y + self["bias"] if "bias" in self else y


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose ``as_linear`` (tied output layers) runs in the kernels.

    Lookups are computed in float32 and come out in ``out_dtype`` (the model's
    activation dtype), whatever the scales' dtype: 16-bit scales must not turn the hidden
    states 16-bit.
    """

    out_dtype: mx.Dtype = mx.float32
    act_bits: int = 0

    def __call__(self, x: mx.array) -> mx.array:
        # The gathered rows' scales in float32: MLX dequantizes in the scales' dtype.
        return mx.dequantize(
            self["weight"][x],
            self["scales"][x].astype(mx.float32),
            self["biases"][x].astype(mx.float32),
            self.group_size,
            self.bits,
        ).astype(self.out_dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return _layer_matmul(self, x)


def _layer_matmul(layer: CpuQuantizedLinear | CpuQuantizedEmbedding, x: mx.array) -> mx.array:
    """x times the layer's quantized weight (transposed), in the kernels."""
    return quantized_matmul(
        x,
        layer["weight"],
        layer["scales"],
        layer["biases"],
        layer.group_size,
        layer.bits,
        layer.act_bits,
    )


def supports(module: nn.Module) -> bool:
    """Whether ``module`` is a quantized layer the kernels compute exactly."""
    if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return False
    scales = module.get("scales")
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.bits in BITS
        and module.group_size % 32 == 0
        and "biases" in module
        and scales is not None
        and scales.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def _float32_scales(module: nn.Module) -> None:
    """16-bit scales and biases of a quantized layer (packed uint32 weight) to float32."""
    weight = module.get("weight")
    if not isinstance(weight, mx.array) or weight.dtype != mx.uint32:
        return
    for name in ("scales", "biases"):
        value = module.get(name)
        if isinstance(value, mx.array) and value.dtype in (mx.float16, mx.bfloat16):
            setattr(module, name, value.astype(mx.float32))


def _widen(layer: nn.Module, bits: int) -> None:
    """Store a kernel layer's values at ``bits`` (wider): the same weights, exactly."""
    packed = np.array(layer["weight"])  # (rows, cols * old bits / 32) uint32
    rows = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])
    layer["weight"] = mx.array(widen(flat, layer.bits, bits).reshape(*rows, -1))
    layer.bits = bits


def use_kernels(model: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Route ``model``'s supported quantized layers through the kernels; how many.

    ``dtype``: the activations' (what embedding lookups return). Their matmuls round
    activations to int8 when :func:`int8_activations` says so.

    2-, 3-, 5- and 6-bit layers are stored at the kernels' fast widths (STORED_BITS).
    Quantized layers the kernels cannot run (other modes, MoE experts' switch layers)
    get float32 scales and biases: MLX's CPU quantized ops are ~10x slower with 16-bit
    ones.
    """
    if not available():
        return 0
    act_bits = 8 if int8_activations() else 0
    swapped = []
    for path, m in model.named_modules():
        if isinstance(m, (CpuQuantizedLinear, CpuQuantizedEmbedding)):
            continue
        if not supports(m):
            _float32_scales(m)
            continue
        cls = CpuQuantizedLinear if isinstance(m, nn.QuantizedLinear) else CpuQuantizedEmbedding
        new = cls.__new__(cls)  # the same parameters and settings, a different __call__
        dict.update(new, m)  # (nn.Module is a dict of its parameters)
        new.__dict__.update(m.__dict__)
        if cls is CpuQuantizedEmbedding:
            new.out_dtype = dtype
        new.act_bits = act_bits
        if new.bits in STORED_BITS:
            _widen(new, STORED_BITS[new.bits])
        swapped.append((path, new))
    if swapped:
        model.update_modules(tree_unflatten(swapped))
    return len(swapped)
