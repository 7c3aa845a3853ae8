"""The mlx-lm architectures mlxserve runs through its adapter, and how one is built.

``build(config, weights)`` makes mlx-lm's own model class for the config (mlx-lm's remapping),
runs its ``sanitize()`` on the HF-named weights, quantizes exactly where the checkpoint is
quantized (mlx-lm's predicate: per-module overrides in ``quantization``, else the settings
inferred from each ``.scales`` tensor), loads strictly, derives one LayerCacheSpec per entry
of ``make_cache()``, and checks the paged path by building (not evaluating) one forward pass.

MODEL_TYPES lists the architectures tests/test_models_zoo.py checks against mlx-lm; others
are refused with the reason, so "supported" always means "tested".
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve.kv_cache_spec import FULL_ATTENTION, SLIDING_WINDOW
from mlxserve.models.base import KVCache
from mlxserve.models.mlx_lm_adapter import (
    _STEP,
    LayerCacheSpec,
    MlxLmModel,
    UnsupportedModelError,
    _Probe,
    install,
    mlx_lm_classes,
)
from mlxserve.models.mlx_lm_recurrent import state_spec
from mlxserve.ops import AttentionMetadata, StateMetadata

# model_type -> the features its zoo case exercises (tests/zoo_configs.py).
FULL, SWA, MOE = "full attention", "sliding window", "MoE"
GDN = "gated delta net (recurrent state slots) + full attention"
MODEL_TYPES: dict[str, str] = {
    "afmoe": f"{SWA}, {MOE} (shared expert, sigmoid routing)",
    "apertus": f"{FULL}, q/k norms, xIELU",
    "bailing_moe": f"{FULL}, {MOE} (shared expert)",
    "cohere": f"{FULL}, parallel block, q/k layer norms, logit scale",
    "cohere2": f"{SWA} every other layer, logit scale",
    "dbrx": f"{FULL}, {MOE}, clipped qkv",
    "deepseek_v2": f"{FULL}, MLA expanded per head (K 24 / V 16 dims), {MOE}, yarn RoPE",
    "dots1": f"{FULL}, {MOE} (shared expert)",
    "ernie4_5": FULL,
    "ernie4_5_moe": f"{FULL}, {MOE}",
    "exaone": FULL,
    "exaone4": f"{SWA} (pattern LLGL)",
    "exaone_moe": f"{SWA}, {MOE}",
    "gemma": f"{FULL}, GeGLU, MQA",
    "gemma3_text": f"{SWA} (local RoPE base), q/k norms",
    "gemma4_text": f"{SWA}, global layers with other head sizes, KV sharing, k=v, {MOE}, "
    "per-layer inputs, logit soft-capping",
    "glm": f"{FULL}, partial RoPE",
    "glm4": f"{FULL}, partial RoPE, post norms",
    "glm4_moe": f"{FULL}, {MOE} (grouped routing)",
    "gpt2": f"{FULL}, learned positions",
    "gpt_neox": f"{FULL}, partial RoPE, parallel residual",
    "gpt_oss": f"{SWA} every other layer, attention sinks, {MOE}",
    "granite": f"{FULL}, muP multipliers",
    "granitemoe": f"{FULL}, {MOE}, muP multipliers",
    "helium": FULL,
    "hunyuan_v1_dense": f"{FULL}, q/k norms",
    "internlm2": f"{FULL}, fused wqkv",
    "internlm3": FULL,
    "laguna": f"{SWA}, {MOE}, gated attention",
    "lille-130m": FULL,
    "llama": f"{FULL}, or {SWA} layers (layer_types)",
    "llama4_text": f"{FULL}, NoPE layers, {MOE}",
    "mellum": f"{SWA}, {MOE}",
    "mimo": FULL,
    "minicpm": f"{FULL}, muP scaling",
    "ministral3": f"{SWA}, yarn RoPE, llama 4 attention scaling",
    "mistral": FULL,
    "mixtral": f"{FULL}, {MOE}",
    "nanochat": f"{FULL}, relu^2",
    "nemotron": f"{FULL}, partial RoPE, relu^2",
    "olmo2": f"{FULL}, q/k norms, post norms",
    "olmo3": f"{SWA}",
    "olmoe": f"{FULL}, {MOE}",
    "openelm": f"{FULL}, per-layer head counts",
    "phi": f"{FULL}, partial RoPE, parallel block",
    "phi3": f"{FULL}, fused qkv, longrope",
    "phimoe": f"{FULL}, {MOE}",
    "qwen": FULL,
    "qwen2": FULL,
    "qwen2_moe": f"{FULL}, {MOE} (shared expert)",
    "qwen3": f"{FULL}, q/k norms",
    "qwen3_moe": f"{FULL}, {MOE}",
    "qwen3_next": f"{GDN}, {MOE} (shared expert), gated attention",
    "qwen3_5": f"{GDN}, gated attention",
    "lfm2": "short convolutions (recurrent state slots) + full attention, q/k norms",
    "granitemoehybrid": "Mamba-2 (recurrent state slots) + full attention, shared MLP",
    "mamba": "Mamba only (recurrent state slots, no KV blocks)",
    "mamba2": "Mamba-2 only (recurrent state slots, no KV blocks)",
    "nemotron_h": "Mamba-2 (recurrent state slots) + full attention + MLP-only layers",
    "qwen3_5_moe": f"{GDN}, {MOE} (shared expert), gated attention",
    "seed_oss": FULL,
    "smollm3": f"{FULL}, NoPE layers",
    "solar_open": f"{FULL}, {MOE}",
    "stablelm": f"{FULL}, partial RoPE, qkv bias",
    "starcoder2": FULL,
    "step3p5": f"{SWA}, {MOE}, head-wise attention gate",
    "telechat3": FULL,
    "youtu_llm": f"{FULL}, MLA expanded per head (K 24 / V 16 dims)",
}

# mlx-lm architectures the adapter refuses, and why (their errors say so too).
NOT_SUPPORTED: dict[str, str] = {
    "gemma2": "computes attention by hand (logit soft-capping), outside the interception",
    "deepseek_v3": "MLA over the latent cache scores RoPE keys by hand (needs an MLA op)",
    "llama4": "chunked local attention (ChunkedKVCache) is not supported yet",
    "plamo3": "masks windows of W + 1 tokens at prefill but its cache keeps W at decode",
    "gpt_bigcode": "turns cache.offset into a Python int (positions must be per token)",
}

# Layers that cast q/k/v to another dtype between update_and_fetch and the attention call.
KV_CAST_AFTER_FETCH = {"stablelm"}

QUANT_METHODS = {  # HF quantization_config.quant_method -> mlx settings (as mlx-lm maps them)
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
}


# Hand-written models stay the default for their model_types; the adapter is tested on them too.
HAND_WRITTEN = ("llama", "mistral", "opt", "qwen2", "qwen3")

# Their K/V pools differ per layer (or K from V): per-layer pools of the layout's shapes.
PER_LAYER_POOLS = ("deepseek_v2", "gemma4_text", "youtu_llm")


def models_table() -> str:
    """docs/models.md's table of architectures (tests/test_mlx_lm_adapter.py keeps them equal)."""
    rows = ["| model_type | runs through | what its test exercises |", "|---|---|---|"]
    for model_type in sorted(set(MODEL_TYPES) | set(HAND_WRITTEN)):
        if model_type in HAND_WRITTEN:
            path = "mlxserve's model" + (
                " (adapter tested too)" if model_type in MODEL_TYPES else ""
            )
        else:
            path = "mlx-lm adapter"
        what = MODEL_TYPES.get(model_type, "full attention, learned positions")
        rows.append(f"| `{model_type}` | {path} | {what} |")
    for model_type, why in sorted(NOT_SUPPORTED.items()):
        rows.append(f"| `{model_type}` | not supported | {why} |")
    return "\n".join(rows)


def why_not(model_type: str) -> str | None:
    """Why an mlx-lm architecture is not run through the adapter (None: it is, or mlx-lm
    does not know the model_type either)."""
    if model_type in MODEL_TYPES:
        return None
    if model_type in NOT_SUPPORTED:
        return NOT_SUPPORTED[model_type]
    if importlib.util.find_spec("mlx_lm") is None:
        return None
    from mlx_lm.utils import MODEL_REMAPPING

    module = f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}"
    if importlib.util.find_spec(module) is not None:
        return "mlx-lm implements it, but mlxserve's adapter is not tested with it yet"
    return None


LoadWeights = Callable[[nn.Module, dict[str, mx.array], "mx.Dtype | None"], None]


def build(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype | None = None,
    load_weights: LoadWeights | None = None,
) -> MlxLmModel:
    """An mlx-lm model for ``config`` with ``weights`` loaded, ready for the block pool.

    ``dtype`` casts floating weights (as ``build_model``); packed quantized weights stay.
    ``load_weights(model, weights, dtype)`` loads them (the registry passes its strict
    loader, which lists every mismatch); by default mlx's strict ``load_weights``.
    """
    model_type = config["model_type"]
    model_cls, args_cls, module = mlx_lm_classes(config)
    install(module)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(dict(weights))
    quantize_like_mlx_lm(model, config, weights)
    (load_weights or _load_weights)(model, weights, dtype)
    model.eval()
    specs, _, vocab_size = cache_specs(model, model_type)
    adapted = MlxLmModel(
        model,
        model_type,
        specs,
        vocab_size,
        config.get("max_position_embeddings"),
        kv_cast_after_fetch=model_type in KV_CAST_AFTER_FETCH,
    )
    check_paged_forward(adapted)
    return adapted


def _load_weights(model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype | None):
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    model.load_weights(list(weights.items()), strict=True)  # as mlx-lm loads them


def quantize_like_mlx_lm(model: nn.Module, config: dict[str, Any], weights: dict) -> None:
    """Swap in quantized modules where the checkpoint has ``<path>.scales``, as mlx-lm does."""
    from mlx_lm.utils import infer_quant_config

    quant = config.get("quantization")
    if quant is None and (qc := config.get("quantization_config")):
        method = qc.get("quant_method")
        quant = QUANT_METHODS.get(method) or (qc if "bits" in qc else None)
        if quant is None:
            raise UnsupportedModelError(
                f"quantization_config quant_method {method!r} is not supported; "
                "convert the checkpoint to MLX format (mlx_lm.convert)"
            )
    if quant is None:
        if any(k.endswith(".scales") for k in weights):
            raise UnsupportedModelError(
                "weights are quantized (.scales tensors) but the config has no 'quantization'"
            )
        return

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = infer_quant_config(path, module, weights)
        if f"{path}.global_scale" in weights:
            params["global_scale"] = True
        return params

    nn.quantize(
        model,
        group_size=quant.get("group_size", 64),
        bits=quant.get("bits", 4),
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def cache_specs(model: nn.Module, model_type: str) -> tuple[list[LayerCacheSpec], bool, int]:
    """(one spec per make_cache() entry, whether layers share K/V, vocab size).

    The cache kinds come from the model's own ``make_cache()``; head counts and sizes (and
    recurrent state shapes) from one (unevaluated) forward pass through those mlx-lm caches.
    """
    from mlx_lm.models import cache as mlx_cache

    caches = mlx_cache.make_prompt_cache(model)
    kinds: list[tuple[str, int | None]] = []
    for i, cache in enumerate(caches):
        if type(cache) is mlx_cache.KVCache:
            kinds.append((FULL_ATTENTION, None))
        elif type(cache) is mlx_cache.RotatingKVCache and cache.keep == 0:
            kinds.append((SLIDING_WINDOW, cache.max_size))
        elif type(cache) is mlx_cache.ArraysCache:
            kinds.append(("recurrent", None))
        else:
            raise UnsupportedModelError(f"{model_type}: {_unsupported_cache(i, cache)}")
    probe = _Probe()
    token = _STEP.set(probe)
    try:
        logits = model(mx.zeros((2, 1), dtype=mx.int32), cache=caches)  # (2, 1, vocab)
    finally:
        _STEP.reset(token)
    specs = []
    for i, ((kind, window), cache) in enumerate(zip(kinds, caches, strict=True)):
        if kind == "recurrent":
            specs.append(state_spec(cache, f"{model_type}: cache layer {i}"))
            continue
        if cache.keys is None:
            raise UnsupportedModelError(f"{model_type}: cache layer {i} is never written")
        _, num_kv_heads, _, k_dim = cache.keys.shape
        specs.append(LayerCacheSpec(kind, num_kv_heads, k_dim, cache.values.shape[-1], window))
    return specs, probe.num_cacheless > 0, logits.shape[-1]


def _unsupported_cache(i: int, cache: object) -> str:
    from mlx_lm.models import cache as mlx_cache

    name = type(cache).__name__
    if isinstance(cache, mlx_cache.ArraysCache):
        why = f"a recurrent state kept in {name} (not a plain ArraysCache) is not supported"
    elif isinstance(cache, mlx_cache.RotatingKVCache):
        why = f"a sliding window that keeps its first {cache.keep} tokens is not supported"
    elif isinstance(cache, mlx_cache.ChunkedKVCache):
        why = "chunked local attention is not supported yet"
    elif isinstance(cache, mlx_cache.CacheList):
        why = "layers with several caches (CacheList) are not supported yet"
    else:
        why = "this cache kind is not supported"
    return f"cache layer {i} ({name}): {why}"


def check_paged_forward(model: MlxLmModel) -> None:
    """Build one paged step (two one-token requests, LM head on the second only) without
    evaluating it: the adapter's checks run while the graph is built."""
    block_size = 2
    layout = model.kv_cache_layout
    cache = KVCache.allocate_layout(layout, 3, block_size, mx.float32, num_state_slots=3)
    md = AttentionMetadata.build([1, 1], [1, 1], [[1], [2]], block_size)
    state_md = StateMetadata.build([0, 0], [1, 2]) if layout.has_state else None
    try:
        logits = model(
            mx.zeros((2,), dtype=mx.int32),
            mx.zeros((2,), dtype=mx.int32),
            md,
            cache,
            logits_indices=mx.array([1], dtype=mx.int32),
            group_metadata=(md,) * layout.num_groups,
            state_metadata=state_md,
        )
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever mlx-lm's code raises, say where
        raise UnsupportedModelError(
            f"{model.model_type}: its layers do not run on one token per row with per-token "
            f"positions ({type(e).__name__}: {e})"
        ) from e
    if logits.shape != (1, model.vocab_size):
        raise UnsupportedModelError(
            f"{model.model_type}: a paged step gave logits of shape {logits.shape}, "
            f"expected (1, {model.vocab_size})"
        )
