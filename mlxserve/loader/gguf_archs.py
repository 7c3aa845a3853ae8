"""What each GGUF ``general.architecture`` is in HF terms: model_type, tensor names, config.

llama.cpp's converter (convert_hf_to_gguf.py) renames HF tensors to its own names, merges
per-expert tensors into one 3-D tensor per projection, and for some architectures changes
values; this module records, per architecture, what undoes that:

- ``permuted_qk``: the converter permuted Q/K rows for llama.cpp's interleaved ("NORM")
  RoPE (LlamaModel and its subclasses: llama, mixtral, granite, smollm3). Architectures
  whose HF RoPE is already interleaved (cohere2) or half-split ("NEOX": qwen*, gemma*,
  phi3, olmo2, gpt-oss) are stored in HF row order.
- ``norm_shift``: Gemma's RMSNorm computes ``x * (1 + w)``; the converter stores ``1 + w``.
- ``layer_names``: block tensor -> HF module, over the common names (LAYER_NAMES).
- ``config``: the HF config fields the architecture needs beyond the common ones, from
  metadata keys, tensor shapes, or llama.cpp's built-in constants where it writes none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Block tensors every architecture names alike (llama.cpp name -> HF module under the layer).
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


def _experts(prefix: str, router: str, stacked: str) -> dict[str, str]:
    """MoE tensors: the router and the stacked experts (mlx-lm's SwitchGLU names)."""
    return {
        "ffn_gate_inp": f"{prefix}.{router}",
        "ffn_gate_exps": f"{prefix}.{stacked}.gate_proj",
        "ffn_up_exps": f"{prefix}.{stacked}.up_proj",
        "ffn_down_exps": f"{prefix}.{stacked}.down_proj",
    }


_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm"}


class Meta:
    """Typed reads of one architecture's metadata keys (``<arch>.<key>``)."""

    def __init__(self, meta: Mapping[str, object], arch: str, path: Path) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: object = None) -> object:
        return self.meta.get(f"{self.arch}.{key}", default)

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.meta

    def number(self, key: str, kind: type, default: object = None) -> int | float:
        """A positive int/float value (corrupt values must not reach the model)."""
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        if not ok or (kind is int and value != int(value)):
            raise ValueError(
                f"{self.path}: {self.arch}.{key} = {value!r} is not a positive {kind.__name__}"
            )
        return kind(value)

    def real(self, key: str, default: float) -> float:
        """A float value of any sign (scales, multipliers)."""
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{self.path}: {self.arch}.{key} = {value!r} is not a number")
        return float(value)


Shapes = Mapping[str, tuple[int, ...]]
ConfigFn = Callable[[Meta, Shapes, dict], dict]


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto an HF model_type (see the module docstring)."""

    model_type: str
    permuted_qk: bool = False
    norm_shift: float = 0.0
    layer_names: Mapping[str, str] = field(default_factory=dict)
    config: ConfigFn | None = None
    rope_scaling_types: tuple[str, ...] = ("none", "linear", "yarn")
    # rope.dimension_count < head_dim is representable (partial_rotary_factor)
    partial_rotary: bool = False

    def names(self) -> dict[str, str]:
        return LAYER_NAMES | dict(self.layer_names)


def _layers_with(shapes: Shapes, part: str) -> list[int]:
    return sorted(int(n.split(".")[1]) for n in shapes if n.endswith(f".{part}.weight"))


def _moe(meta: Meta, shapes: Shapes, experts_key: str = "num_experts") -> dict:
    """Expert counts and sizes (the expert size from the stacked tensors when not given)."""
    gate = next((s for n, s in shapes.items() if n.endswith(".ffn_gate_exps.weight")), None)
    out = {
        experts_key: meta.number("expert_count", int),
        "num_experts_per_tok": meta.number("expert_used_count", int),
    }
    if gate is not None:
        out["moe_intermediate_size"] = meta.number("expert_feed_forward_length", int, gate[1])
    return out


def _qwen3_moe(meta: Meta, shapes: Shapes, config: dict) -> dict:
    # Layers with a dense MLP (ffn_gate) instead of experts are HF's mlp_only_layers;
    # llama.cpp's qwen3moe always renormalizes the top-k weights (norm_topk_prob).
    return _moe(meta, shapes) | {
        "decoder_sparse_step": 1,
        "mlp_only_layers": _layers_with(shapes, "ffn_gate"),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", True)),
    }


def _qwen2_moe(meta: Meta, shapes: Shapes, config: dict) -> dict:
    shared = next((s for n, s in shapes.items() if n.endswith(".ffn_gate_shexp.weight")), None)
    if shared is None:
        raise ValueError(f"{meta.path}: a qwen2moe file without shared experts (ffn_gate_shexp)")
    default = shared[0]
    size = meta.number("expert_shared_feed_forward_length", int, default)
    return _moe(meta, shapes) | {"shared_expert_intermediate_size": size}


def _olmoe(meta: Meta, shapes: Shapes, config: dict) -> dict:
    return _moe(meta, shapes) | {"norm_topk_prob": bool(meta.get("expert_weights_norm", False))}


def _mixtral(meta: Meta, shapes: Shapes, config: dict) -> dict:
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(
            f"{meta.path}: a llama file with experts (Mixtral) must have head_dim = "
            f"hidden size / heads, got {config['head_dim']}"
        )
    out = _moe(meta, shapes, experts_key="num_local_experts")
    out.pop("moe_intermediate_size", None)  # Mixtral's experts use intermediate_size
    return out


def _gemma3(meta: Meta, shapes: Shapes, config: dict) -> dict:
    window = meta.get("attention.sliding_window")
    # llama.cpp hard-codes what the converter does not write: one global layer in six,
    # local RoPE base 10000, and the query scale 1/sqrt(head_dim) except for the 27B
    # (62 layers), which scales by 1/sqrt(hidden / heads).
    pattern = 6 if window is not None else 1
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    if meta.get("final_logit_softcapping") or meta.get("attention.logit_softcapping"):
        raise ValueError(f"{meta.path}: gemma3 with logit soft-capping is not supported")
    return {
        "sliding_window": int(window) if window is not None else config["max_position_embeddings"],
        "sliding_window_pattern": meta.number("attention.sliding_window_pattern", int, pattern),
        "rope_local_base_freq": meta.number("rope.freq_base_swa", float, 10000.0),
        "query_pre_attn_scalar": scalar,
    }


def _granite(meta: Meta, shapes: Shapes, config: dict) -> dict:
    return {
        "logits_scaling": meta.real("logit_scale", 1.0),
        "attention_multiplier": meta.real("attention.scale", config["head_dim"] ** -0.5),
        "embedding_multiplier": meta.real("embedding_scale", 1.0),
        "residual_multiplier": meta.real("residual_scale", 1.0),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in shapes,
    }


def _cohere2(meta: Meta, shapes: Shapes, config: dict) -> dict:
    # llama.cpp: one global (no RoPE) layer in four unless the file says otherwise.
    return {
        "layer_norm_eps": meta.number("attention.layer_norm_epsilon", float, 1e-5),
        "logit_scale": meta.real("logit_scale", 1.0),
        "sliding_window": meta.number("attention.sliding_window", int),
        "sliding_window_pattern": meta.number("attention.sliding_window_pattern", int, 4),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "layer_norm_bias": "blk.0.attn_norm.bias" in shapes,
    }


def _smollm3(meta: Meta, shapes: Shapes, config: dict) -> dict:
    # llama.cpp's smollm3 skips RoPE in every 4th layer (n_no_rope_layer_step = 4).
    return {"no_rope_layer_interval": 4}


def _phi3(meta: Meta, shapes: Shapes, config: dict) -> dict:
    # The longrope factors come as tensors (rope_factors_long/short, read by the loader).
    rope_dims = meta.number("rope.dimension_count", int, config["head_dim"])
    return {
        "partial_rotary_factor": rope_dims / config["head_dim"],
        "original_max_position_embeddings": meta.number(
            "rope.scaling.original_context_length", int, config["max_position_embeddings"]
        ),
    }


def _gpt_oss(meta: Meta, shapes: Shapes, config: dict) -> dict:
    # llama.cpp alternates sliding (even layers) and full attention, as HF's layer_types.
    out = _moe(meta, shapes, experts_key="num_local_experts")
    out["intermediate_size"] = out.pop("moe_intermediate_size", config["intermediate_size"])
    out["sliding_window"] = meta.number("attention.sliding_window", int)
    return out


_GATE_UP = {"ffn_up": "mlp.gate_up_proj"}

ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", permuted_qk=True, rope_scaling_types=("none", "linear")),
    "qwen2": ArchSpec("qwen2", rope_scaling_types=("none", "linear")),
    "qwen3": ArchSpec("qwen3", rope_scaling_types=("none", "linear")),
    "qwen3moe": ArchSpec(
        "qwen3_moe", layer_names=_experts("mlp", "gate", "switch_mlp"), config=_qwen3_moe
    ),
    "qwen2moe": ArchSpec(
        "qwen2_moe",
        layer_names=_experts("mlp", "gate", "switch_mlp") | _SHARED_EXPERT,
        config=_qwen2_moe,
    ),
    "olmoe": ArchSpec("olmoe", layer_names=_experts("mlp", "gate", "switch_mlp"), config=_olmoe),
    "gemma3": ArchSpec(
        "gemma3_text",
        norm_shift=1.0,
        layer_names=_POST_NORMS
        | {"ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        config=_gemma3,
    ),
    "olmo2": ArchSpec(
        "olmo2",
        layer_names=_POST_NORMS | {"post_ffw_norm": "post_feedforward_layernorm"},
    ),
    "granite": ArchSpec("granite", permuted_qk=True, config=_granite),
    "cohere2": ArchSpec("cohere2", config=_cohere2),
    "smollm3": ArchSpec("smollm3", permuted_qk=True, config=_smollm3),
    "phi3": ArchSpec(
        "phi3",
        layer_names={"attn_qkv": "self_attn.qkv_proj"} | _GATE_UP,
        config=_phi3,
        partial_rotary=True,
    ),
    "gpt-oss": ArchSpec(
        "gpt_oss",
        layer_names=_POST_NORMS
        | _experts("mlp", "router", "experts")
        | {"attn_sinks": "self_attn.sinks"},
        config=_gpt_oss,
    ),
}
# A llama file with experts is Mixtral (llama.cpp's converter writes Mixtral as llama).
MIXTRAL = ArchSpec(
    "mixtral",
    permuted_qk=True,
    layer_names=_experts("block_sparse_moe", "gate", "switch_mlp"),
    config=_mixtral,
)

# HF parameters stored without a .weight suffix (llama.cpp adds one).
BARE_PARAMETERS = ("self_attn.sinks",)


def arch_spec(arch: str, tensor_names: list[str] | set[str]) -> ArchSpec | None:
    """The spec of a GGUF architecture (Mixtral for llama files with experts), or None."""
    if arch == "llama" and any(n.endswith(".ffn_gate_exps.weight") for n in tensor_names):
        return MIXTRAL
    return ARCHS.get(arch)


def gguf_table() -> str:
    """The README's table of GGUF architectures (tests/test_loader_gguf_families.py keeps
    them equal)."""
    rows = ["| GGUF `general.architecture` | HF `model_type` | converter fixes undone |"]
    rows.append("|---|---|---|")
    specs = sorted([*ARCHS.items(), ("llama (with experts)", MIXTRAL)])
    for arch, spec in specs:
        fixes = []
        if spec.permuted_qk:
            fixes.append("Q/K row permutation")
        if spec.norm_shift:
            fixes.append("norm weights stored as 1 + w")
        if any(
            v.endswith(("switch_mlp.gate_proj", "experts.gate_proj")) for v in spec.names().values()
        ):
            fixes.append("experts stacked")
        rows.append(f"| `{arch}` | `{spec.model_type}` | {', '.join(fixes) or '-'} |")
    return "\n".join(rows)
