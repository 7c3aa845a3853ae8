"""HF checkpoints -> GGUF as llama.cpp's converter (convert_hf_to_gguf.py) writes them.

The test oracle is mlx-lm's model on HF-named weights; this module takes those weights in
the HF checkpoint layout and writes what the converter would, following its documented
conventions per architecture (an implementation independent of mlxserve's loader):

- tensor names from the gguf package's own HF -> GGUF map (``gguf.get_tensor_name_map``),
  per-expert tensors merged into one (experts, rows, cols) tensor first (Qwen2MoeModel,
  LlamaModel for Mixtral);
- LlamaModel and its subclasses (llama/Mixtral, granite, smollm3) permute Q/K rows;
- Gemma3Model stores ``1 + w`` for every ``*norm.weight``;
- GptOssModel splits the interleaved ``gate_up_proj`` rows into gate and up, repacks the
  MXFP4 blocks into GGML's MXFP4 (exponent byte + nibbles in ggml order), and names the
  sinks ``attn_sinks.weight``;
- metadata keys as TextModel.set_gguf_parameters and each model class write them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from mlx.utils import tree_flatten

from tests.gguf_helpers import close_gguf, encode_tensor, llamacpp_permute, llamacpp_unpermute

# model_type -> (GGUF arch, converter permutes Q/K, norm shift)
ARCHS = {
    "llama": ("llama", True, 0.0),
    "qwen2": ("qwen2", False, 0.0),
    "qwen3": ("qwen3", False, 0.0),
    "qwen3_moe": ("qwen3moe", False, 0.0),
    "qwen2_moe": ("qwen2moe", False, 0.0),
    "olmoe": ("olmoe", False, 0.0),
    "mixtral": ("llama", True, 0.0),
    "gemma3_text": ("gemma3", False, 1.0),
    "olmo2": ("olmo2", False, 0.0),
    "granite": ("granite", True, 0.0),
    "cohere2": ("cohere2", False, 0.0),
    "smollm3": ("smollm3", True, 0.0),
    "phi3": ("phi3", False, 0.0),
    "gpt_oss": ("gpt-oss", False, 0.0),
}


def hf_checkpoint(model_type: str, model) -> dict[str, np.ndarray]:
    """An mlx-lm model's weights in the HF checkpoint layout (float32 numpy; gpt-oss's
    quantized experts as HF's MXFP4 ``*_blocks`` / ``*_scales``).

    mlx-lm's ``sanitize`` stacks HF's per-expert tensors; here they are split back.
    """
    out: dict[str, np.ndarray] = {}
    for name, value in tree_flatten(model.parameters()):
        if value.dtype == mx.bfloat16:
            value = value.astype(mx.float32)
        out[name] = np.array(value)
    if model_type == "gpt_oss":
        return _gpt_oss_checkpoint(out)
    hf: dict[str, np.ndarray] = {}
    moe_names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for name, value in out.items():
        m = re.match(r"(.*)\.switch_mlp\.(\w+)\.weight$", name)
        if m is None:
            hf[name] = value
            continue
        prefix, proj = m.groups()
        for e in range(value.shape[0]):  # HF: one tensor per expert
            expert = moe_names[proj] if model_type == "mixtral" else proj
            hf[f"{prefix}.experts.{e}.{expert}.weight"] = value[e]
    return hf


def _gpt_oss_checkpoint(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gpt-oss's HF layout: gate and up rows interleaved in ``gate_up_proj``; MXFP4 experts
    as ``*_blocks`` (experts, rows, cols / 32, 16) uint8 and ``*_scales`` uint8, float ones
    transposed to (experts, cols, rows) without a suffix."""
    hf: dict[str, np.ndarray] = {}
    pattern = r"(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|scales|bias)$"
    for name, value in weights.items():
        m = re.match(pattern, name)
        if m is None:
            hf[name] = value
            continue
        prefix, proj, kind = m.groups()
        if proj == "up_proj":
            continue  # interleaved with gate_proj
        if proj == "gate_proj":
            up = weights[f"{prefix}.up_proj.{kind}"]
            both = np.empty((value.shape[0], 2 * value.shape[1], *value.shape[2:]), value.dtype)
            both[:, 0::2], both[:, 1::2] = value, up
            value = both
        base = f"{prefix}.{'gate_up_proj' if proj == 'gate_proj' else 'down_proj'}"
        if kind == "weight" and value.dtype != np.uint32:
            hf[base] = value.transpose(0, 2, 1)
        elif kind == "weight":  # MLX's packed bytes are HF's blocks, 16 bytes per 32 values
            hf[f"{base}_blocks"] = value.view(np.uint8).reshape(*value.shape[:2], -1, 16)
        elif kind == "scales":
            hf[f"{base}_scales"] = value
        else:
            hf[f"{base}_bias"] = value
    return hf


def _merge_experts(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The converter's expert merge: ``experts.{e}.X.weight`` -> ``experts.X.weight``."""
    merged: dict[str, list[tuple[int, np.ndarray]]] = {}
    out = {}
    for name, value in hf.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(\w+\.weight)$", name)
        if m is None:
            out[name] = value
        else:
            merged.setdefault(f"{m.group(1)}.{m.group(3)}", []).append((int(m.group(2)), value))
    for name, parts in merged.items():
        out[name] = np.stack([v for _, v in sorted(parts, key=lambda p: p[0])])
    return out


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 (low nibble = even element) -> GGML blocks (exponent, then byte j holding
    elements j (low) and j + 16 (high)): GptOssModel.repack_mxfp4."""
    lo, hi = blocks & 0x0F, blocks >> 4  # elements 2i, 2i + 1
    codes = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    ggml = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], ggml], axis=-1)  # (experts, rows, blocks, 17)
    return out.reshape(*out.shape[:2], -1).astype(np.uint8)


def write_llamacpp_gguf(
    path: Path,
    config: dict[str, Any],
    hf: dict[str, np.ndarray],
    qtypes: dict[str, QT] | None = None,
    extra_metadata: dict[str, Any] | None = None,
    stub_vocab: bool = False,
) -> dict[str, np.ndarray]:
    """Write HF checkpoint weights of ``config`` as llama.cpp's converter would.

    ``qtypes`` maps a GGUF tensor name suffix ("ffn_gate_exps.weight") to a type; the
    default is F32 (MXFP4 experts stay MXFP4, as the converter keeps them). Returns the
    float weights a correct reader must produce for the non-MXFP4 tensors (HF checkpoint
    names with experts merged, HF row order): gguf's dequantization of the bytes written.
    ``stub_vocab`` adds a vocabulary, so llama.cpp can load the file.
    """
    expected: dict[str, np.ndarray] = {}
    model_type = config["model_type"]
    arch, permuted, norm_shift = ARCHS[model_type]
    num_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], num_layers)
    if arch == "gpt-oss":
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, num_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch)
    if stub_vocab:
        _write_stub_vocab(writer, config["vocab_size"])
    for key, value in (extra_metadata or {}).items():
        writer.add_float32(key, value) if isinstance(value, float) else writer.add_uint32(
            key, value
        )
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hf = _merge_experts(hf)
    pending_mxfp4: dict[str, dict[str, np.ndarray]] = {}
    for name, value in hf.items():
        if name.endswith(("_blocks", "_scales")):  # gpt-oss MXFP4: repacked below
            base, kind = name.rsplit("_", 1)
            pending_mxfp4.setdefault(base, {})[kind] = value
            continue
        if name.endswith("_bias"):  # gpt-oss expert biases
            if "gate_up_proj" in name:
                for part, sl in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    part_name = name.replace("gate_up_proj_bias", f"{part}.bias")
                    _add(writer, names, part_name, value[..., sl], qtypes)
            else:
                _add(writer, names, name.replace("_bias", ".bias"), value, qtypes)
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # float experts
            value = value.transpose(0, 2, 1)  # GptOssModel.modify_tensors
            if name.endswith("gate_up_proj"):
                for part, sl in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    part_name = name.replace("gate_up_proj", part) + ".weight"
                    expected[part_name] = _add(writer, names, part_name, value[:, sl], qtypes)
            else:
                expected[name + ".weight"] = _add(writer, names, name + ".weight", value, qtypes)
            continue
        if name.endswith(".sinks"):
            name += ".weight"  # GptOssModel.filter_tensors
        permute = None
        if permuted and re.search(r"\.(q|k)_proj\.(weight|bias)$", name):
            permute = heads if ".q_proj." in name else kv_heads
            value = llamacpp_permute(value, permute)
        if norm_shift and name.endswith("norm.weight"):
            value = value + norm_shift
        readback = _add(writer, names, name, value, qtypes) - (
            norm_shift if name.endswith("norm.weight") else 0.0
        )
        expected[name] = readback if permute is None else llamacpp_unpermute(readback, permute)
    for base, parts in pending_mxfp4.items():
        blocks, scales = parts["blocks"], parts["scales"]
        if base.endswith("gate_up_proj"):
            for part, sl in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                raw = _ggml_mxfp4(blocks[:, sl], scales[:, sl])
                gname = names.get_name(base.replace("gate_up_proj", part) + ".weight", (".weight",))
                writer.add_tensor(gname, raw, raw_dtype=QT.MXFP4)
        else:
            writer.add_tensor(
                names.get_name(base + ".weight", (".weight",)),
                _ggml_mxfp4(blocks, scales),
                raw_dtype=QT.MXFP4,
            )
    close_gguf(writer)
    return expected


def _add(
    writer, names, hf_name: str, value: np.ndarray, qtypes: dict[str, QT] | None
) -> np.ndarray:
    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert gguf_name is not None, hf_name
    qtype = next((q for suffix, q in (qtypes or {}).items() if gguf_name.endswith(suffix)), QT.F32)
    if value.ndim < 2:
        qtype = QT.F32  # the converter keeps 1-D tensors (norms, biases) in F32
    rows = value.reshape(-1, value.shape[-1])
    raw, readback = encode_tensor(rows, qtype)
    if raw.dtype == np.uint8:
        writer.add_tensor(gguf_name, raw.reshape(*value.shape[:-1], -1), raw_dtype=qtype)
    else:
        writer.add_tensor(gguf_name, raw.reshape(value.shape))
    return readback.reshape(value.shape)


def _write_metadata(writer: gguf.GGUFWriter, c: dict[str, Any], arch: str) -> None:
    """TextModel.set_gguf_parameters plus each model class's own keys."""
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c.get("max_position_embeddings", 2048))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    writer.add_rope_freq_base(c.get("rope_theta", 10000.0))
    if "rms_norm_eps" in c:
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if "layer_norm_eps" in c:
        writer.add_layer_norm_eps(c["layer_norm_eps"])
    if (experts := c.get("num_local_experts", c.get("num_experts"))) is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c["num_experts_per_tok"])
    if "head_dim" in c:
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    scaling = c.get("rope_scaling") or {}
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    if arch in ("qwen3moe", "qwen2moe"):  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch == "gemma3" and c.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(c["sliding_window"])
    if arch == "granite":
        writer.add_attention_scale(c["attention_multiplier"])
        writer.add_embedding_scale(c["embedding_multiplier"])
        writer.add_residual_scale(c["residual_multiplier"])
        writer.add_logit_scale(c["logits_scaling"])
    if arch == "cohere2":
        writer.add_logit_scale(c["logit_scale"])
        writer.add_sliding_window(c["sliding_window"])
        writer.add_vocab_size(c["vocab_size"])
        writer.add_rope_dimension_count(
            c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        )
    if arch == "phi3":  # Phi3MiniModel: its own set_gguf_parameters
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        writer.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        writer.add_rope_dimension_count(int(c.get("partial_rotary_factor", 1.0) * head_dim))
        writer.add_sliding_window(c.get("sliding_window") or 0)
        if (scaling := c.get("rope_scaling")) is not None:  # generate_extra_tensors
            orig = c["original_max_position_embeddings"]
            scale = c["max_position_embeddings"] / orig
            factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(factor)  # llama.cpp needs it; mlx-lm derives it
            writer.add_tensor(
                "rope_factors_long.weight", np.array(scaling["long_factor"], np.float32)
            )
            writer.add_tensor(
                "rope_factors_short.weight", np.array(scaling["short_factor"], np.float32)
            )
    if arch == "gpt-oss":
        writer.add_sliding_window(c["sliding_window"])
        writer.add_expert_feed_forward_length(c["intermediate_size"])


def _write_stub_vocab(writer: gguf.GGUFWriter, size: int) -> None:
    """A byte-level BPE vocabulary of ``size`` tokens that each decode to whole UTF-8 text
    (so llama-server reports a log-prob per token): what llama.cpp needs to load a file;
    callers pass token ids, never text."""
    tokens = ["\u0120", "\u0120\u0120", *(f"<t{i}>" for i in range(size - 4)), "<s>", "</s>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (size - 2) + [3, 3])
    writer.add_token_merges(["\u0120 \u0120"])  # llama.cpp refuses a BPE vocab without merges
    writer.add_bos_token_id(size - 2)
    writer.add_eos_token_id(size - 1)
    writer.add_add_bos_token(False)
