"""Model registry (HF ``model_type`` -> architecture) and ``build_model`` (config + weights).

Weights load strictly (every parameter present with its exact shape, nothing left over), and
mlx-community quantized checkpoints load as nn.QuantizedLinear / nn.QuantizedEmbedding.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.models import llama, mlx_lm_zoo, opt, qwen2, qwen3
from mlxserve.models.base import KVCache

__all__ = ["KVCache", "build_model", "get_model_class", "supported_model_types"]

MODEL_MODULES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "opt": opt,
}
QUANT_KEYS = ("group_size", "bits", "mode")
DEFAULT_QUANT = {"group_size": 64, "bits": 4, "mode": "affine"}


def supported_model_types() -> list[str]:
    """HF ``model_type`` values mlxserve can run (hand-written, or mlx-lm's through the
    adapter: mlxserve.models.mlx_lm_zoo)."""
    return sorted(set(MODEL_MODULES) | set(mlx_lm_zoo.MODEL_TYPES))


def get_model_class(model_type: str) -> tuple[type[nn.Module], type]:
    """(Model, ModelArgs) for an HF ``model_type``."""
    module = MODEL_MODULES.get(model_type)
    if module is None:
        raise ValueError(unsupported_message(model_type))
    return module.Model, module.ModelArgs


def unsupported_message(model_type: str) -> str:
    """Why ``model_type`` cannot be loaded (mlx-lm's reason when it has the architecture)."""
    why = mlx_lm_zoo.why_not(model_type)
    return (
        f"unsupported model_type {model_type!r}"
        + (f" ({why})" if why else "")
        + (f"; supported: {', '.join(supported_model_types())}")
    )


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype | None = None,
) -> nn.Module:
    """Build the model named by ``config["model_type"]`` and load ``weights`` into it.

    ``dtype`` casts every floating parameter (quantization scales/biases included); packed
    quantized weights keep their integer type. With ``dtype=None`` nothing is cast.
    ``tie_word_embeddings`` missing from the config means "tied unless lm_head.* is present".
    """
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError("model config has no 'model_type'")
    if model_type not in MODEL_MODULES and model_type in mlx_lm_zoo.MODEL_TYPES:
        # mlx-lm's class through the adapter; hand-written models stay the default.
        return mlx_lm_zoo.build(config, weights, dtype, load_weights_strict)
    model_cls, args_cls = get_model_class(model_type)
    config = dict(config)
    if "tie_word_embeddings" not in config:
        config["tie_word_embeddings"] = not any(k.startswith("lm_head.") for k in weights)
    model = model_cls(args_cls.from_dict(config))
    weights = model.sanitize(dict(weights))
    quantize_like_checkpoint(model, quantization_config(config), weights)
    load_weights_strict(model, weights, dtype)
    model.eval()
    return model


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The mlx-format quantization dict (``quantization``, or ``quantization_config``) or None."""
    quant = config.get("quantization")
    if quant is None:
        quant = config.get("quantization_config")
        if quant is not None and "quant_method" in quant and "bits" not in quant:
            raise ValueError(
                f"quantization_config quant_method {quant['quant_method']!r} is not supported; "
                "convert the checkpoint to MLX format (mlx_lm.convert)"
            )
    return quant


def quantize_like_checkpoint(
    model: nn.Module, quant: dict[str, Any] | None, weights: dict[str, mx.array]
) -> None:
    """Swap in quantized modules exactly where the checkpoint has ``<path>.scales``.

    Per-module settings come from ``quant[<path>]`` (a dict of group_size/bits/mode, or False
    for "not quantized"), else from the top-level group_size/bits/mode.
    """
    quantized_paths = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    if not quantized_paths:
        return
    if quant is None:
        example = sorted(quantized_paths)[0]
        raise ValueError(
            f"weights are quantized (e.g. {example}.scales) but the config has no "
            "'quantization' entry giving group_size and bits"
        )
    defaults = {k: quant.get(k, DEFAULT_QUANT[k]) for k in QUANT_KEYS}

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path not in quantized_paths or not hasattr(module, "to_quantized"):
            return False  # leftover .scales then fail strict loading as unexpected
        override = quant.get(path)
        if override is False:
            raise ValueError(
                f"checkpoint has {path}.scales but the quantization config marks {path} "
                "as not quantized (False)"
            )
        params = dict(defaults)
        if isinstance(override, dict):
            params.update({k: override[k] for k in QUANT_KEYS if k in override})
        in_dims = module.weight.shape[-1]
        if in_dims % params["group_size"]:
            raise ValueError(
                f"{path}: input size {in_dims} is not a multiple of quantization "
                f"group_size {params['group_size']}"
            )
        return params

    nn.quantize(model, class_predicate=predicate)


def load_weights_strict(
    model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype | None = None
) -> None:
    """Load weights after checking names and shapes.

    A ValueError names the first problem and counts the others by kind, in one line: a
    config that disagrees with its checkpoint makes every tensor a problem (hundreds).
    """
    expected = dict(tree_flatten(model.parameters()))
    problems: list[tuple[str, str]] = []  # (kind, description)
    problems += [("missing", f"missing weight {n}") for n in sorted(set(expected) - set(weights))]
    problems += [
        ("unexpected", f"unexpected weight {n}") for n in sorted(set(weights) - set(expected))
    ]
    for name in sorted(set(expected) & set(weights)):
        want, got = expected[name], weights[name]
        if tuple(want.shape) != tuple(got.shape):
            problems.append(
                (
                    "wrong shape",
                    f"wrong shape for {name}: expected {tuple(want.shape)}, got {tuple(got.shape)}",
                )
            )
        elif _is_float(want.dtype) != _is_float(got.dtype):
            problems.append(
                ("wrong dtype", f"wrong dtype for {name}: expected {want.dtype}, got {got.dtype}")
            )
    if problems:
        kind = type(model).__module__.rsplit(".", 1)[-1]
        raise ValueError(f"cannot load {kind} weights: {problems[0][1]}{_more(problems[1:])}")
    if dtype is not None:
        weights = {k: v.astype(dtype) if _is_float(v.dtype) else v for k, v in weights.items()}
    model.update(tree_unflatten(list(weights.items())))


def _more(problems: list[tuple[str, str]]) -> str:
    """'' or '; and 694 more problems (690 wrong shape, 4 missing)'."""
    if not problems:
        return ""
    counts: dict[str, int] = {}
    for kind, _ in problems:
        counts[kind] = counts.get(kind, 0) + 1
    parts = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    noun = "problem" if len(problems) == 1 else "problems"
    return f"; and {len(problems)} more {noun} ({parts})"


def _is_float(dtype: mx.Dtype) -> bool:
    return mx.issubdtype(dtype, mx.floating)


def dequantize_model(model: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Replace quantized layers by float ones holding the same values; returns how many.

    On the CPU with an optimized BLAS, a float32 matmul is ~20x faster than MLX's CPU
    quantized matmul, so small quantized models run faster dequantized.
    """

    def as_float(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return None
        w = mx.dequantize(
            module.weight,
            module.scales,
            module.biases,
            module.group_size,
            module.bits,
            mode=module.mode,
        ).astype(dtype)  # (out, in)
        if isinstance(module, nn.QuantizedEmbedding):
            out = nn.Embedding(*w.shape)
        else:
            out = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
            if "bias" in module:
                out.bias = module.bias.astype(dtype)
        out.weight = w
        return out

    replaced = [
        (path, new) for path, m in model.named_modules() if (new := as_float(m)) is not None
    ]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())
    return len(replaced)


def quantized_bytes_as_float(model: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Bytes the model's quantized layers would take dequantized to dtype."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = m.weight.shape
            total += rows * packed * 32 // m.bits * dtype.size
    return total
