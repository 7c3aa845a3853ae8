"""Read a .gguf file into an HF-style config and HF-named MLX weights."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

from mlxserve.gguf_file import GGUFHeader, read_gguf_header, read_tensor_bytes
from mlxserve.loader.gguf_quants import GROUP_SIZE, convert_tensor

# GGUF general.architecture -> HF model_type (the registry key of mlxserve.models).
ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# llama.cpp stores Q/K rows of these architectures permuted for its interleaved ("NORM")
# RoPE; qwen2/qwen3 use its NEOX RoPE, which is HF's half-split rotation: rows as in HF.
PERMUTED_QK_ARCHS = {"llama"}

# Llama 3.1+ files carry llama.cpp's per-frequency RoPE divisors instead of scaling metadata.
ROPE_FREQS = "rope_freqs.weight"
# Tensors llama.cpp files may hold that mlxserve recomputes itself.
_IGNORED_RE = re.compile(r"^blk\.\d+\.attn_rot_embd\.weight$")
ROPE_SCALING_TYPES = ("none", "linear")
# Tensor types MLX's own GGUF reader (mx.load) handles; it gets files with only these.
MX_LOAD_TYPES = {QT.F32, QT.F16, QT.Q4_0, QT.Q4_1, QT.Q8_0}

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None: unknown)."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part not in LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    if (m := _TOP_RE.match(gguf_name)) and m.group(1) in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def check_architecture(meta: dict[str, object], path: Path) -> str:
    """general.architecture, if mlxserve runs it; else a ValueError naming it."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCH_TO_MODEL_TYPE:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(sorted(ARCH_TO_MODEL_TYPE))}"
        )
    return arch


def make_config(
    meta: dict[str, object], tensor_shapes: dict[str, tuple[int, ...]], path: Path
) -> dict:
    """An HF config.json-like dict from GGUF metadata and the tensors' (rows, cols) shapes."""
    arch = check_architecture(meta, path)

    def get(key: str, default: object = None) -> object:
        return meta.get(f"{arch}.{key}", default)

    def number(key: str, kind: type, default: object = None) -> int | float:
        """A positive int/float metadata value (corrupt values must not reach the model)."""
        value = get(key, default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        if not ok or (kind is int and value != int(value)):
            raise ValueError(f"{path}: {arch}.{key} = {value!r} is not a positive {kind.__name__}")
        return kind(value)

    required = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    heads = number("attention.head_count", int)
    hidden = number("embedding_length", int)
    head_dim = number("attention.key_length", int, hidden // heads)
    config: dict = {
        "model_type": ARCH_TO_MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": number("block_count", int),
        "intermediate_size": number("feed_forward_length", int),
        "num_attention_heads": heads,
        "num_key_value_heads": number("attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": number("rope.freq_base", float, 10000.0),
        "max_position_embeddings": number("context_length", int, 2048),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "vocab_size": _vocab_size(meta, arch, tensor_shapes, path),
    }
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(
            f"{path}: {arch}.rope.dimension_count = {rope_dims} differs from the head size "
            f"{head_dim}; partial rotary embeddings are not supported"
        )
    if scaling := _rope_scaling(meta, arch, path):
        config["rope_scaling"] = scaling
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


def _rope_scaling(meta: dict[str, object], arch: str, path: Path) -> dict | None:
    """rope_scaling from <arch>.rope.scaling.* (or the older <arch>.rope.scale_linear)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind is None or kind == "none":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"{path}: unsupported RoPE scaling {arch}.rope.scaling.type = {kind!r}; "
            f"supported: {', '.join(ROPE_SCALING_TYPES)}"
        )
    if factor is None:
        raise ValueError(f"{path}: {arch}.rope.scaling.type is {kind!r} but no factor is given")
    if float(factor) == 1.0:
        return None
    return {"type": "linear", "factor": float(factor)}


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

    Quantized tensors come as ``name.weight`` (packed uint32) + ``name.scales`` +
    ``name.biases``; ``config["quantization"]`` gives their group size and bits.
    ``keep_float`` dequantizes every quantized tensor to float32 instead.
    """
    header = read_gguf_header(path)
    meta = header.metadata
    arch = check_architecture(meta, path)
    config = make_config(meta, {t.name: t.shape for t in header.tensors}, path)
    layers = {int(m.group(1)) for t in header.tensors if (m := _LAYER_RE.match(t.name))}
    num_layers = config["num_hidden_layers"]
    if len(layers) != num_layers or max(layers, default=-1) != num_layers - 1:
        have = sorted(layers)[:8] or "none"
        if layers and layers == set(range(len(layers))):
            have = f"0..{len(layers) - 1}"
        raise ValueError(
            f"{path}: {arch}.block_count is {num_layers} but the file has tensors for layers {have}"
        )
    unknown = [t.name for t in header.tensors if hf_tensor_name(t.name) is None]
    unknown = [n for n in unknown if n != ROPE_FREQS and not _IGNORED_RE.match(n)]
    if unknown:
        raise ValueError(
            f"{path}: tensor(s) mlxserve's {arch} model has no place for: {', '.join(unknown[:5])}"
        )
    weights: dict[str, mx.array] = {}
    layer_bits: dict[str, int] = {}
    for gguf_name, parts in _read_tensors(path, header, keep_float):
        if gguf_name == ROPE_FREQS:
            config["rope_scaling"] = freq_factors_scaling(parts["weight"], config, path)
            continue
        hf_name = hf_tensor_name(gguf_name)
        if hf_name is None:
            continue
        module = hf_name.rsplit(".", 1)[0]
        if "scales" in parts:
            cols = parts["scales"].shape[1] * GROUP_SIZE
            layer_bits[module] = parts["weight"].shape[1] * 32 // cols
        if arch in PERMUTED_QK_ARCHS and module.endswith(("q_proj", "k_proj")):
            key = "num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"
            rows = config[key] * config["head_dim"]
            if parts["weight"].shape[0] != rows:
                raise ValueError(
                    f"{path}: tensor {gguf_name} has {parts['weight'].shape[0]} rows, but the "
                    f"metadata says {config[key]} heads x {config['head_dim']} = {rows}"
                )
            parts = {k: unpermute_rows(v, config[key]) for k, v in parts.items()}
        for kind, arr in parts.items():
            weights[hf_name if kind == "weight" else f"{module}.{kind}"] = arr
    if layer_bits:
        counts = list(layer_bits.values())
        bits = max(set(counts), key=counts.count)
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits} | {
            m: {"group_size": GROUP_SIZE, "bits": b} for m, b in layer_bits.items() if b != bits
        }
    return config, weights, meta


def _read_tensors(
    path: Path, header: GGUFHeader, keep_float: bool
) -> list[tuple[str, dict[str, mx.array]]]:
    """(gguf name, {"weight", maybe "scales"/"biases"}) per tensor.

    ``mx.load`` reads files whose tensors are all of the types in MX_LOAD_TYPES in C++,
    fast (into the same bits :func:`convert_tensor` produces, which a test checks); it is
    only given files whose header has been checked. Other files go through numpy.
    """
    if not keep_float and all(t.qtype in MX_LOAD_TYPES for t in header.tensors):
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
            tensors.append((t.name, parts))
        return tensors
    tensors = []
    for t in header.tensors:
        try:
            parts = convert_tensor(read_tensor_bytes(path, t), t.qtype, t.shape, keep_float)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {t.name}: {e}") from None
        tensors.append((t.name, parts))
    return tensors
