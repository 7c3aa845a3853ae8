"""Frozen settings for the block pool, the scheduler and the engine."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from mlxserve.exceptions import ParameterError
from mlxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroupSpec

# vLLM's --dtype names ("half" and "float" are its aliases); the loader maps them to MLX dtypes.
DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
# KV cache storage (vLLM's --kv-cache-dtype): the activation dtype (auto), or 8-bit values
# with a float32 scale per token and KV head (int8; mlxserve/ops/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "int8")
# Why int4 is refused: measured, see bench/kv_cache_dtype.py and docs/kv-cache.md.
INT4_REASON = (
    "4-bit K/V was measured too inaccurate: on the default model greedy outputs leave the "
    "float cache's after ~2 of 64 tokens (both per-row symmetric and mlx-lm's affine 4-bit; "
    "int8: after ~39), see docs/kv-cache.md; use int8"
)


def check_kv_cache_dtype(value: object) -> None:
    """ParameterError naming the value and what is supported, unless it is supported."""
    if value in KV_CACHE_DTYPES:
        return
    supported = f"supported: {', '.join(KV_CACHE_DTYPES)}"
    if isinstance(value, str) and value.lower().startswith("fp8"):
        why = "FP8 KV caches are not implemented (MLX has no fp8 type); use int8 for 8-bit"
    elif value == "int4":
        why = INT4_REASON
    elif value in ("float16", "half", "bfloat16", "float32", "float"):
        why = "a float cache takes the activation dtype: set --dtype, keep kv_cache_dtype auto"
    else:
        why = "unknown value"
    raise ParameterError(
        f"kv_cache_dtype (--kv-cache-dtype) {value!r} is not supported: {why}; {supported}",
        parameter="kv_cache_dtype",
    )


# Attention kernels: Metal where it can run (auto), always Metal, or the pure-MLX fallback.
KERNEL_CHOICES = ("auto", "metal", "fallback")


def default_kernels() -> str:
    """The ``kernels`` default: MLXSERVE_KERNELS if set, else auto."""
    return os.environ.get("MLXSERVE_KERNELS", "").strip().lower() or "auto"


# vLLM-on-CPU guides size the KV cache with this variable (GiB; 0 or unset: not set).
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def default_kv_cache_memory_bytes() -> int | None:
    """The ``kv_cache_memory_bytes`` default: $VLLM_CPU_KVCACHE_SPACE GiB if set, else None."""
    text = os.environ.get(KV_CACHE_SPACE_ENV, "").strip()
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        raise ParameterError(
            f"{KV_CACHE_SPACE_ENV} must be a number of GiB, got {text!r}",
            parameter="kv_cache_memory_bytes",
        ) from None
    if not gib >= 0 or gib == float("inf"):
        raise ParameterError(
            f"{KV_CACHE_SPACE_ENV} must be a finite number of GiB >= 0, got {text!r}",
            parameter="kv_cache_memory_bytes",
        )
    return int(gib * 2**30) or None


@dataclass(frozen=True)
class CacheConfig:
    """The KV block pool: how many blocks of how many tokens, and prefix caching.

    Built by the engine from a validated EngineConfig, so its invariants are asserted.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Blocks that exist at start; the pool grows on demand up to num_blocks (None: all).
    initial_blocks: int | None = None
    # The model's KV cache groups (mlxserve/kv_cache_spec.py); default one full-attention.
    groups: tuple[KVCacheGroupSpec, ...] = (KVCacheGroupSpec(FULL_ATTENTION, None, ()),)
    # Recurrent-state slots, the null slot included (0: the model has no recurrent layers).
    num_state_slots: int = 0
    # Snapshot recurrent states every this many tokens too (0: only at prompt ends and
    # while decoding); a multiple of block_size.
    snapshot_interval: int = 0

    def __post_init__(self) -> None:
        # Block 0 is the null block, so a usable pool needs at least two.
        assert self.block_size >= 1 and self.num_blocks >= 2, self
        assert self.num_state_slots != 1 and self.snapshot_interval % self.block_size == 0


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the scheduler (built by the engine; invariants asserted)."""

    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        assert self.max_model_len >= 2 and self.max_num_seqs >= 1, self
        assert self.max_num_batched_tokens >= 1, self


# Speculative decoding methods (vLLM's names).
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's per-architecture spellings of the MTP method (it maps them to "mtp" too).
MTP_ALIASES = ("deepseek_mtp", "mimo_mtp", "glm4_moe_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` fields).

    ``ngram`` (prompt lookup): the drafts are the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``. ``draft_model``: a smaller model with the same tokenizer,
    ``model`` (a path, hub id or .gguf, as the engine's model), drafts autoregressively.
    ``mtp``: the model's own multi-token-prediction layer (glm4_moe, mimo checkpoints).
    No speculation when more than ``disable_by_batch_size`` requests run (verifying drafts
    of a big batch costs more than it saves).
    """

    method: str = "ngram"
    model: str | None = None  # the draft model (method draft_model)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    # 2: a single-token match (a common word, a comma) predicts little and costs a step.
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 8
    # A request whose recent drafts were accepted at less than this rate pauses proposing.
    min_acceptance_rate: float = 0.2
    # Measure seconds per emitted token with and without drafts and speculate only while
    # drafts cost less (core/spec_cost.py).
    disable_by_cost: bool = True

    def __post_init__(self) -> None:
        field_ = "speculative_config."
        _require(
            self.method in SPECULATIVE_METHODS,
            field_ + "method",
            self.method,
            f"one of {', '.join(SPECULATIVE_METHODS)}",
        )
        if self.method == "draft_model":
            _require(
                isinstance(self.model, str) and bool(self.model),
                field_ + "model",
                self.model,
                "a model path or hub id (method draft_model)",
            )
        else:
            _require(
                self.model is None,
                field_ + "model",
                self.model,
                f"unset with method {self.method!r} (a draft model needs method draft_model)",
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, 32),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
            ("disable_by_batch_size", 1, 1 << 20),
        ):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                field_ + name,
                value,
                f"an integer in [{low}, {high}]",
            )
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            field_ + "prompt_lookup_min",
            self.prompt_lookup_min,
            f"<= prompt_lookup_max ({self.prompt_lookup_max})",
        )
        _require(
            isinstance(self.disable_by_cost, bool),
            field_ + "disable_by_cost",
            self.disable_by_cost,
            "true or false",
        )
        rate = self.min_acceptance_rate
        _require(
            isinstance(rate, int | float) and 0.0 <= rate <= 1.0,
            field_ + "min_acceptance_rate",
            rate,
            "in [0, 1]",
        )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping | str | None) -> SpeculativeConfig | None:
        """From a dict or a JSON object string (the CLI's); unknown fields are an error."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ParameterError(
                    f"speculative_config must be a JSON object, got {value!r} ({e})",
                    parameter="speculative_config",
                ) from None
        if not isinstance(value, Mapping):
            raise ParameterError(
                f"speculative_config must be a JSON object, got {value!r}",
                parameter="speculative_config",
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ParameterError(
                f"unknown speculative_config field(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}",
                parameter=f"speculative_config.{unknown[0]}",
            )
        if value.get("method") in MTP_ALIASES:
            value = {**value, "method": "mtp"}
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": "draft_model"}  # vLLM infers it from the model
        if "method" not in value:
            raise ParameterError(
                f"speculative_config.method is required (one of {', '.join(SPECULATIVE_METHODS)})",
                parameter="speculative_config.method",
            )
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything a user can set when starting an engine (vLLM's engine-arg names).

    ``None`` means "derive it": from the model (max_model_len) or from memory
    (num_blocks via memory_fraction).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # None: engine.default_max_num_batched_tokens (2048; a server on the CPU: 32).
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    # "auto" (the activation dtype) or "int8" (8-bit K/V with per-row scales).
    kv_cache_dtype: str = "auto"
    memory_fraction: float = 0.5
    # The KV pool's size in bytes, instead of what memory_fraction leaves (vLLM's knob).
    kv_cache_memory_bytes: int | None = field(default_factory=default_kv_cache_memory_bytes)
    enable_prefix_caching: bool = True
    # The prefix cache's disk tier (engine/kv_disk.py): a folder and a byte budget
    # shared by every model's blocks there; 0 bytes or no folder: off.
    kv_cache_disk_dir: str | None = None
    kv_cache_disk_bytes: int = 0
    chat_template: str | None = None
    served_model_name: str | None = None
    enforce_eager: bool = False
    revision: str | None = None
    # Checked against the machine when the engine starts (metal needs a Metal GPU).
    kernels: str = field(default_factory=default_kernels)
    # Processes the model's layers are split over (rank 0 is the engine's own; the others
    # are started on this machine, or by mlx.launch: mlxserve/worker/launch.py).
    tensor_parallel_size: int = 1
    # Processes the model's layers are split over, in contiguous ranges (pipeline parallel:
    # mlxserve/models/pipeline_parallel.py); not together with tensor parallel (yet).
    pipeline_parallel_size: int = 1
    # Pipeline parallel: a step's requests are split into micro-batches (at most one per
    # stage) only when each gets about this many tokens: below that a step reads the
    # weights once per micro-batch for little compute (decode is bandwidth-bound).
    pipeline_micro_batch_tokens: int = 64
    # Not implemented yet: must be 1.
    data_parallel_size: int = 1
    # Tensor / pipeline parallel: a step (or start-up planning) that makes no progress for
    # this long means a rank is stuck; the ranks are stopped and the engine fails.
    distributed_timeout_seconds: float = 120.0
    # Speculative decoding (None: off); a dict or JSON string is parsed into the dataclass.
    speculative_config: SpeculativeConfig | None = None
    # Schedule and launch step N+1 before step N's tokens reach the host (vLLM's
    # --async-scheduling), where nothing needs them there (engine/llm_engine.py).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.max_model_len is not None:
            # A request needs at least one prompt token and room for one output token.
            _require(
                self.max_model_len >= 2,
                "max_model_len",
                self.max_model_len,
                ">= 2 (1 prompt token + 1 output token)",
            )
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        if self.max_num_batched_tokens is not None:
            _require(
                self.max_num_batched_tokens >= 1,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                ">= 1",
            )
        _require(1 <= self.block_size <= 256, "block_size", self.block_size, "in [1, 256]")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.num_blocks is not None:
            _require(self.num_blocks >= 2, "num_blocks", self.num_blocks, ">= 2")
        _require(
            0.0 < self.memory_fraction <= 1.0,
            "memory_fraction (gpu_memory_utilization)",
            self.memory_fraction,
            "in (0, 1]",
        )
        if self.kv_cache_memory_bytes is not None:
            _require(
                self.kv_cache_memory_bytes >= 1,
                "kv_cache_memory_bytes",
                self.kv_cache_memory_bytes,
                ">= 1",
            )
        _require(
            self.kv_cache_disk_bytes >= 0, "kv_cache_disk_bytes", self.kv_cache_disk_bytes, ">= 0"
        )
        _require(
            self.data_parallel_size == 1,
            "data_parallel_size",
            self.data_parallel_size,
            "1 for now: data parallelism is not implemented (run one server per machine)",
        )
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _require(
            self.tensor_parallel_size == 1 or self.pipeline_parallel_size == 1,
            "pipeline_parallel_size",
            self.pipeline_parallel_size,
            f"1 with tensor_parallel_size {self.tensor_parallel_size}: tensor and pipeline "
            "parallelism do not combine yet; use one of them",
        )
        _require(
            self.pipeline_micro_batch_tokens >= 1,
            "pipeline_micro_batch_tokens",
            self.pipeline_micro_batch_tokens,
            ">= 1",
        )
        sc = self.speculative_config
        if sc is not None and (sc.model is not None or sc.method == "mtp"):
            # The draft model (or MTP layer) runs on rank 0 only; the SPMD step protocol
            # carries host token ids, and a draft's tokens exist only on the device.
            what = "an MTP layer (method mtp)" if sc.method == "mtp" else "a draft model"
            for name in ("tensor_parallel_size", "pipeline_parallel_size"):
                _require(
                    getattr(self, name) == 1,
                    name,
                    getattr(self, name),
                    f"1 with {what} (speculative_config): use method ngram, or one process",
                )
        _require(
            self.distributed_timeout_seconds > 0,
            "distributed_timeout_seconds",
            self.distributed_timeout_seconds,
            "> 0",
        )
        _require(
            self.kernels in KERNEL_CHOICES,
            "kernels (MLXSERVE_KERNELS)",
            self.kernels,
            f"one of {', '.join(KERNEL_CHOICES)}",
        )

    @property
    def world_size(self) -> int:
        """Processes the model runs on (tensor x pipeline parallel)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from keyword arguments; accepts vLLM aliases, rejects unknown names."""
        if "gpu_memory_utilization" in kwargs:
            kwargs["memory_fraction"] = kwargs.pop("gpu_memory_utilization")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ParameterError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known | {'gpu_memory_utilization'}))}",
                parameter=unknown[0],
            )
        return cls(**kwargs)  # type: ignore[arg-type]


def _require(ok: bool, name: str, value: object, limit: str) -> None:
    if not ok:
        raise ParameterError(f"{name} must be {limit}, got {value!r}", parameter=name.split()[0])
