"""Read a .gguf file into an HF-style config and HF-named MLX weights."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

from mlxserve.gguf_file import GGUFHeader, read_gguf_header, read_tensor_bytes
from mlxserve.loader.gguf_archs import ARCHS, BARE_PARAMETERS, ArchSpec, Meta, arch_spec
from mlxserve.loader.gguf_quants import FLOAT_TYPES, GROUP_SIZE, MXFP4_MODE, convert_tensor

# Llama 3.1+ files carry llama.cpp's per-frequency RoPE divisors instead of scaling metadata.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's longrope factors (HF rope_scaling long_factor / short_factor).
ROPE_FACTORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}
# Tensors llama.cpp files may hold that mlxserve recomputes itself.
_IGNORED_RE = re.compile(r"^blk\.\d+\.attn_rot_embd\.weight$")
# Tensor types MLX's own GGUF reader (mx.load) handles; it gets files with only these.
MX_LOAD_TYPES = {QT.F32, QT.F16, QT.Q4_0, QT.Q4_1, QT.Q8_0}
# gpt-oss's experts may come fused (converter option): gate rows, then up rows.
FUSED_GATE_UP = "ffn_gate_up_exps"

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str, spec: ArchSpec = ARCHS["llama"]) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None: unknown)."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        names = spec.names()
        if part not in names:
            return None
        module = f"model.layers.{layer}.{names[part]}"
        return module if module.endswith(BARE_PARAMETERS) else f"{module}.{kind}"
    if (m := _TOP_RE.match(gguf_name)) and m.group(1) in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def check_architecture(meta: dict[str, object], path: Path, tensor_names=()) -> ArchSpec:
    """The spec of general.architecture, if mlxserve runs it; else a ValueError naming it."""
    arch = str(meta.get("general.architecture", ""))
    spec = arch_spec(arch, tensor_names)
    if spec is None:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(sorted(ARCHS))}"
        )
    return spec


def make_config(
    meta: dict[str, object], tensor_shapes: dict[str, tuple[int, ...]], path: Path
) -> dict:
    """An HF config.json-like dict from GGUF metadata and the tensors' (rows, cols) shapes."""
    spec = check_architecture(meta, path, tensor_shapes)
    arch = str(meta["general.architecture"])
    m = Meta(meta, arch, path)
    required = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    missing = [f"{arch}.{k}" for k in required if not m.has(k)]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    heads = m.number("attention.head_count", int)
    hidden = m.number("embedding_length", int)
    head_dim = m.number("attention.key_length", int, hidden // heads)
    config: dict = {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": m.number("block_count", int),
        "intermediate_size": m.number("feed_forward_length", int),
        "num_attention_heads": heads,
        "num_key_value_heads": m.number("attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": m.number("rope.freq_base", float, 10000.0),
        "max_position_embeddings": m.number("context_length", int, 2048),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "vocab_size": _vocab_size(meta, arch, tensor_shapes, path),
    }
    rope_dims = m.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and not spec.partial_rotary:
        raise ValueError(
            f"{path}: {arch}.rope.dimension_count = {rope_dims} differs from the head size "
            f"{head_dim}; partial rotary embeddings are not supported"
        )
    if scaling := _rope_scaling(meta, arch, path, spec.rope_scaling_types):
        config["rope_scaling"] = scaling
    if spec.config is not None:
        config |= spec.config(m, tensor_shapes, config)
    return config


def _vocab_size(
    meta: dict[str, object], arch: str, tensor_shapes: dict[str, tuple[int, ...]], path: Path
) -> int:
    """<arch>.vocab_size, else the token embedding's rows, else the tokenizer's token count."""
    if (n := meta.get(f"{arch}.vocab_size")) is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"{path}: {arch}.vocab_size = {n!r} is not a positive int")
        return n
    if "token_embd.weight" in tensor_shapes:
        return int(tensor_shapes["token_embd.weight"][0])
    if isinstance(tokens := meta.get("tokenizer.ggml.tokens"), list):
        return len(tokens)
    raise ValueError(f"{path}: no {arch}.vocab_size, token_embd.weight or tokenizer.ggml.tokens")


def _rope_scaling(
    meta: dict[str, object], arch: str, path: Path, supported: tuple[str, ...]
) -> dict | None:
    """rope_scaling from <arch>.rope.scaling.* (or the older <arch>.rope.scale_linear)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind is None or kind == "none":
        return None
    if kind not in supported:
        raise ValueError(
            f"{path}: unsupported RoPE scaling {arch}.rope.scaling.type = {kind!r}; "
            f"supported: {', '.join(supported)}"
        )
    if factor is None:
        raise ValueError(f"{path}: {arch}.rope.scaling.type is {kind!r} but no factor is given")
    if float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    # YaRN as HF writes it; llama.cpp's converter copies these keys from the HF config.
    m = Meta(meta, arch, path)
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": m.number("rope.scaling.original_context_length", int),
        "beta_fast": m.number("rope.scaling.yarn_beta_fast", float, 32.0),
        "beta_slow": m.number("rope.scaling.yarn_beta_slow", float, 1.0),
    }


def freq_factors_scaling(factors: mx.array, config: dict, path: Path) -> dict:
    """rope_scaling for llama.cpp's rope_freqs tensor: one divisor per rotary frequency."""
    if "rope_scaling" in config:
        raise ValueError(f"{path}: both {ROPE_FREQS} and rope scaling metadata are present")
    if factors.shape != (config["head_dim"] // 2,):
        raise ValueError(
            f"{path}: {ROPE_FREQS} has shape {tuple(factors.shape)}, "
            f"expected ({config['head_dim'] // 2},) (head_dim / 2)"
        )
    return {"rope_type": "freq_factors", "freq_factors": factors.astype(mx.float32).tolist()}


def unpermute_rows(w: mx.array, num_heads: int) -> mx.array:
    """Undo llama.cpp's per-head row interleave so HF's half-split RoPE applies.

    llama.cpp row order within a head is (j, r) for r in {0, 1}, j < head_dim/2;
    HF's is (r, j). Rows of packed quantized weights, scales and biases move alike.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, keep_float: bool = False) -> tuple[dict, dict[str, mx.array], dict]:
    """(config, weights, metadata) of a GGUF file; weights use HF names.

    Quantized tensors come as ``name.weight`` (packed uint32) + ``name.scales`` (+
    ``name.biases`` in MLX's affine mode); ``config["quantization"]`` gives their group
    size, bits and mode. ``keep_float`` dequantizes every quantized tensor to float32.
    """
    header = read_gguf_header(path)
    meta = header.metadata
    shapes = {t.name: t.shape for t in header.tensors}
    spec = check_architecture(meta, path, shapes)
    arch = str(meta["general.architecture"])
    config = make_config(meta, shapes, path)
    _check_layers(header, config["num_hidden_layers"], arch, path)
    special = {ROPE_FREQS, *ROPE_FACTORS}
    unknown = [
        t.name
        for t in header.tensors
        if _hf_name(t.name, spec) is None
        and t.name not in special
        and not _IGNORED_RE.match(t.name)
    ]
    if unknown:
        raise ValueError(
            f"{path}: tensor(s) mlxserve's {arch} model has no place for: {', '.join(unknown[:5])}"
        )
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}  # module -> its MLX quantization settings
    rope_factors: dict[str, list[float]] = {}
    for gguf_name, qtype, parts in _read_tensors(path, header, keep_float):
        if gguf_name == ROPE_FREQS:
            if spec.model_type != "llama":
                raise ValueError(f"{path}: {ROPE_FREQS} is only supported in llama files")
            config["rope_scaling"] = freq_factors_scaling(parts["weight"], config, path)
            continue
        if gguf_name in ROPE_FACTORS:
            rope_factors[ROPE_FACTORS[gguf_name]] = parts["weight"].astype(mx.float32).tolist()
            continue
        for hf_name, part in _split_fused(gguf_name, parts, spec):
            module = hf_name.rsplit(".", 1)[0]
            if "scales" in part:
                quant[module] = _quant_mode(part, qtype)
            if spec.norm_shift and hf_name.endswith("norm.weight") and qtype in FLOAT_TYPES:
                part = {"weight": part["weight"] - spec.norm_shift}
            if spec.permuted_qk and module.endswith(("q_proj", "k_proj")):
                part = _unpermute(part, config, module, gguf_name, path)
            for kind, arr in part.items():
                weights[hf_name if kind == "weight" else f"{module}.{kind}"] = arr
    if rope_factors:
        if set(rope_factors) != set(ROPE_FACTORS.values()):
            raise ValueError(f"{path}: rope_factors_long and rope_factors_short come together")
        config["rope_scaling"] = {"type": "longrope", **rope_factors}
    if quant:
        config["quantization"] = _quantization_config(quant)
    return config, weights, meta


def _check_layers(header: GGUFHeader, num_layers: int, arch: str, path: Path) -> None:
    layers = {int(m.group(1)) for t in header.tensors if (m := _LAYER_RE.match(t.name))}
    if len(layers) != num_layers or max(layers, default=-1) != num_layers - 1:
        have = sorted(layers)[:8] or "none"
        if layers and layers == set(range(len(layers))):
            have = f"0..{len(layers) - 1}"
        raise ValueError(
            f"{path}: {arch}.block_count is {num_layers} but the file has tensors for layers {have}"
        )


def _hf_name(gguf_name: str, spec: ArchSpec) -> str | None:
    """hf_tensor_name, knowing the fused gate/up experts (split by _split_fused)."""
    if (m := _LAYER_RE.match(gguf_name)) and m.group(2) == FUSED_GATE_UP:
        if "ffn_gate_exps" in spec.names():
            return f"model.layers.{m.group(1)}.{FUSED_GATE_UP}"
    return hf_tensor_name(gguf_name, spec)


def _split_fused(
    gguf_name: str, parts: dict[str, mx.array], spec: ArchSpec
) -> list[tuple[str, dict[str, mx.array]]]:
    """[(hf name, parts)]: one tensor, or the gate and up halves of fused experts."""
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) != FUSED_GATE_UP:
        return [(hf_tensor_name(gguf_name, spec), parts)]
    out = []
    for index, part in enumerate(("ffn_gate_exps", "ffn_up_exps")):
        half = {}
        for kind, arr in parts.items():
            rows = arr.shape[-2] if arr.ndim == 3 else arr.shape[-1]  # biases: (experts, rows)
            sl = slice(index * rows // 2, (index + 1) * rows // 2)
            half[kind] = arr[:, sl] if arr.ndim == 3 else arr[..., sl]
        out.append((hf_tensor_name(f"blk.{m.group(1)}.{part}.{m.group(3)}", spec), half))
    return out


def _quant_mode(parts: dict[str, mx.array], qtype: QT) -> dict:
    if qtype == QT.MXFP4:
        return dict(MXFP4_MODE)
    cols = parts["scales"].shape[-1] * GROUP_SIZE
    return {"group_size": GROUP_SIZE, "bits": parts["weight"].shape[-1] * 32 // cols}


def _quantization_config(quant: dict[str, dict]) -> dict:
    """The most common settings at the top level, the others per module."""
    settings = [tuple(sorted(q.items())) for q in quant.values()]
    common = dict(max(set(settings), key=settings.count))
    return common | {m: q for m, q in quant.items() if q != common}


def _unpermute(
    parts: dict[str, mx.array], config: dict, module: str, gguf_name: str, path: Path
) -> dict[str, mx.array]:
    key = "num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"
    rows = config[key] * config["head_dim"]
    if parts["weight"].shape[0] != rows:
        raise ValueError(
            f"{path}: tensor {gguf_name} has {parts['weight'].shape[0]} rows, but the "
            f"metadata says {config[key]} heads x {config['head_dim']} = {rows}"
        )
    return {k: unpermute_rows(v, config[key]) for k, v in parts.items()}


def _read_tensors(
    path: Path, header: GGUFHeader, keep_float: bool
) -> list[tuple[str, QT, dict[str, mx.array]]]:
    """(gguf name, type, {"weight", maybe "scales"/"biases"}) per tensor.

    ``mx.load`` reads files whose tensors are all of the types in MX_LOAD_TYPES in C++,
    fast (into the same bits :func:`convert_tensor` produces, which a test checks); it is
    only given files whose header has been checked. Other files go through numpy.
    """
    simple = [
        t.qtype in FLOAT_TYPES or (t.qtype in MX_LOAD_TYPES and len(t.shape) <= 2)
        for t in header.tensors
    ]  # quantized expert stacks (3-D) go through numpy
    if not keep_float and all(t.qtype in MX_LOAD_TYPES for t in header.tensors) and all(simple):
        try:
            arrays = mx.load(str(path))
        except Exception as e:  # noqa: BLE001 -- MLX raises RuntimeError/ValueError variously
            raise ValueError(f"{path}: unreadable GGUF file ({e})") from None
        tensors = []
        for t in header.tensors:
            parts = {"weight": arrays[t.name]}
            base = t.name.rsplit(".", 1)[0]
            if f"{base}.scales" in arrays:
                parts |= {"scales": arrays[f"{base}.scales"], "biases": arrays[f"{base}.biases"]}
            tensors.append((t.name, t.qtype, parts))
        return tensors
    tensors = []
    for t in header.tensors:
        try:
            parts = convert_tensor(read_tensor_bytes(path, t), t.qtype, t.shape, keep_float)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {t.name}: {e}") from None
        tensors.append((t.name, t.qtype, parts))
    return tensors
