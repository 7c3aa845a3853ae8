"""Engine start-up: the other ranks, the ModelRunner with its drafter, the KV memory plan,
and the defaults the plan and the scheduler are sized by.

start_runner():  start_ranks (world_size > 1) -> keep_this_ranks_part -> ModelRunner
                 -> drafter (draft model or MTP layer) -> plan_kv_cache
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlxserve.config import EngineConfig, SpeculativeConfig
from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.loader import LoadedModel
from mlxserve.utils import cdiv, uses_gpu
from mlxserve.worker.drafter import load_drafter
from mlxserve.worker.launch import LaunchedRanks, LocalRanks, keep_this_ranks_part, start_ranks
from mlxserve.worker.memory import KVPlan
from mlxserve.worker.model_runner import ModelRunner
from mlxserve.worker.mtp import load_mtp
from mlxserve.worker.spmd import StepChannel

logger = logging.getLogger("mlxserve")

# Default token budget per step. Offline jobs and the one-user chat want throughput:
# big prefill chunks. A server on the CPU wants small ones: there a step's time grows
# with its tokens (~2.5 ms of CPU per prompt token for a 135M model), so a large chunk
# stalls every decoding stream (bench/README.md, "The CPU server's step budget": beside
# 8 streams a step costs 2.2x a decode-only one at 32, 3.6x at 64, 6.4x at 128).
# On Metal a prefill chunk costs little next to the decodes sharing its step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 32
# Fewest blocks between two recurrent-state snapshots inside one prompt.
SNAPSHOT_MIN_BLOCKS = 16


def default_max_num_batched_tokens(serving: bool = False) -> int:
    """The step token budget when the config leaves it unset (None)."""
    if serving and not uses_gpu():
        return CPU_SERVING_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS


def snapshot_interval(layout: KVCacheLayout, block_size: int, dtype) -> int:
    """Tokens between recurrent-state snapshots inside long prompts: as many as one
    snapshot's bytes of K/V (so snapshots cost about what the prefix's KV costs), rounded
    to whole blocks, at least SNAPSHOT_MIN_BLOCKS blocks; 0 without recurrent layers."""
    if not layout.has_state:
        return 0
    per_token = max(layout.bytes_per_block(block_size, dtype) // block_size, 1)
    blocks = cdiv(layout.state_bytes_per_slot() // per_token, block_size)
    return max(blocks, SNAPSHOT_MIN_BLOCKS) * block_size


def prefix_caching_off(enabled: bool) -> str | None:
    """Why prefix caching is off, or None: every KV cache group and recurrent state the
    adapter runs supports it (windows keep their last blocks, states are snapshotted)."""
    return None if enabled else "enable_prefix_caching is False"


def log_prefix_caching(off: str | None, has_state: bool) -> None:
    """The start-up log line saying whether prefix caching is on, and why not."""
    logger.info(
        "prefix caching: %s",
        f"off ({off})"
        if off
        else "on" + (" (recurrent state: snapshots at block boundaries)" if has_state else ""),
    )


@dataclass
class Started:
    """What start_runner made: the other ranks (None in one process), the runner, the plan."""

    ranks: LocalRanks | LaunchedRanks | None
    runner: ModelRunner
    plan: KVPlan


def start_runner(config: EngineConfig, loaded: LoadedModel, max_num_batched_tokens: int) -> Started:
    """Start the other tensor/pipeline-parallel ranks, build this rank's runner and its
    drafter, and plan the KV pool; on any failure the started ranks are killed."""
    plan_args = dict(
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        memory_fraction=config.memory_fraction,
        num_blocks=config.num_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    ranks = start_ranks(loaded, config, plan_args) if config.world_size > 1 else None
    channel = None
    try:
        if ranks is not None:
            keep_this_ranks_part(loaded, config, ranks.group)
            channel = StepChannel(ranks.group, ranks.lost, ranks.name)
            ranks.progress.begin("start-up (planning the KV pool)")
        runner = ModelRunner(
            loaded.model,
            dtype=loaded.dtype,
            block_size=config.block_size,
            kernels=config.kernels,
            seed=config.seed,
            channel=channel,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        sc = config.speculative_config
        if sc is not None and sc.method == "mtp":
            runner.drafter = load_mtp(config, loaded, runner)
        elif sc is not None and sc.model is not None and not runner.layout.has_state:
            runner.drafter = load_drafter(config, loaded.tokenizer, runner)
        plan = runner.plan_kv_cache(**plan_args)
        if ranks is not None:
            ranks.progress.end()
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise
    return Started(ranks, runner, plan)


def speculation(sc: SpeculativeConfig | None, layout: KVCacheLayout) -> SpeculativeConfig | None:
    """The speculative decoding the engine runs (None: off), said in the start-up log."""
    if sc is None:
        return None
    if layout.has_state:
        # A recurrent state cannot be rolled back past rejected drafts (yet).
        logger.warning("speculative decoding: off (the model has recurrent layers)")
        return None
    logger.info(
        "speculative decoding: %s, %d draft tokens, %s, off above %d running requests"
        + (", and while drafts cost more per token" if sc.disable_by_cost else ""),
        sc.method,
        sc.num_speculative_tokens,
        f"draft model {sc.model}"
        if sc.model
        else "the model's MTP layer"
        if sc.method == "mtp"
        else f"n-gram {sc.prompt_lookup_min}..{sc.prompt_lookup_max}",
        sc.disable_by_batch_size,
    )
    return sc
