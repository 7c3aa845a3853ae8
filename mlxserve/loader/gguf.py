"""Read a .gguf file into an HF-style config and HF-named MLX weights."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from mlxserve.loader.gguf_quants import GROUP_SIZE, convert_tensor

# GGUF general.architecture -> HF model_type (the registry key of mlxserve.models).
ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# llama.cpp stores Q/K rows of these architectures permuted for its interleaved RoPE.
PERMUTED_QK_ARCHS = {"llama"}

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


def plain_metadata(meta: dict[str, object]) -> dict[str, object]:
    """Metadata values as plain Python (mx.load gives mx.array for numbers)."""
    return {k: v.tolist() if isinstance(v, mx.array) else v for k, v in meta.items()}


def read_metadata(reader) -> dict[str, object]:
    """GGUF key/value metadata from a gguf.GGUFReader, as plain Python values."""
    meta: dict[str, object] = {}
    for name, field in reader.fields.items():
        try:
            meta[name] = field.contents()
        except Exception:  # noqa: BLE001 -- an odd field must not block loading the rest
            continue
    return meta


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None: not needed)."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part not in LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    if (m := _TOP_RE.match(gguf_name)) and m.group(1) in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def make_config(meta: dict[str, object], tensor_names: set[str], path: Path) -> dict:
    """An HF config.json-like dict from GGUF metadata."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCH_TO_MODEL_TYPE:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(sorted(ARCH_TO_MODEL_TYPE))}"
        )

    def get(key: str, default: object = None) -> object:
        return meta.get(f"{arch}.{key}", default)

    required = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    config: dict = {
        "model_type": ARCH_TO_MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if get("vocab_size") is not None:
        config["vocab_size"] = int(get("vocab_size"))
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        if scaling != "linear":
            raise ValueError(f"{path}: unsupported GGUF rope scaling type {scaling!r}")
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    return config


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
    """
    meta, tensors = _read(path, keep_float)
    names = {name for name, _ in tensors}
    config = make_config(meta, names, path)
    arch = str(meta["general.architecture"])
    weights: dict[str, mx.array] = {}
    layer_bits: dict[str, int] = {}
    for gguf_name, parts in tensors:
        hf_name = hf_tensor_name(gguf_name)
        if hf_name is None:
            continue
        module = hf_name.rsplit(".", 1)[0]
        if "scales" in parts:
            cols = parts["scales"].shape[1] * GROUP_SIZE
            layer_bits[module] = parts["weight"].shape[1] * 32 // cols
        if arch in PERMUTED_QK_ARCHS and module.endswith(("q_proj", "k_proj")):
            key = "num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"
            parts = {k: unpermute_rows(v, config[key]) for k, v in parts.items()}
        for kind, arr in parts.items():
            weights[hf_name if kind == "weight" else f"{module}.{kind}"] = arr
    if layer_bits:
        counts = [b for b in layer_bits.values()]
        bits = max(set(counts), key=counts.count)
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits} | {
            m: {"group_size": GROUP_SIZE, "bits": b} for m, b in layer_bits.items() if b != bits
        }
    return config, weights, meta


def _read(path: Path, keep_float: bool) -> tuple[dict, list[tuple[str, dict[str, mx.array]]]]:
    """Metadata and (gguf name, {"weight", maybe "scales"/"biases"}) per tensor.

    ``mx.load`` reads GGUFs whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 in C++ (the
    bits :func:`convert_tensor` produces too, which a test checks). It refuses other
    types; then each tensor goes through the gguf package and numpy.
    """
    if not keep_float:
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
        except Exception:  # noqa: BLE001 -- unsupported types or not a GGUF: try gguf
            pass
        else:
            tensors = []
            for name, arr in arrays.items():
                base, kind = name.rsplit(".", 1)
                if kind in ("scales", "biases"):
                    continue
                parts = {"weight": arr}
                if kind == "weight" and f"{base}.scales" in arrays:
                    parts |= {
                        "scales": arrays[f"{base}.scales"],
                        "biases": arrays[f"{base}.biases"],
                    }
                tensors.append((name, parts))
            return plain_metadata(meta), tensors
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    tensors = []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (columns) first
        try:
            tensors.append((t.name, convert_tensor(t.data, t.tensor_type, shape, keep_float)))
        except ValueError as e:
            raise ValueError(f"{path}: tensor {t.name}: {e}") from None
    return read_metadata(reader), tensors
