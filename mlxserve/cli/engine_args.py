"""Engine flags every sub-command shares (vLLM's names), and the EngineConfig they make."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from mlxserve.cli.vllm_compat import ENGINE_FLAGS, add_no_effect_flags, human_int, warn_no_effect
from mlxserve.config import DTYPES, KV_CACHE_DTYPES, KV_CACHE_SPACE_ENV, EngineConfig
from mlxserve.cpu.blas import user_cache_dir

DEFAULT_DISK_BYTES = 4 * 2**30  # `serve`'s KV disk tier: a few long agent sessions


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flag names."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        help="hub repo id, model directory or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer source, if not the model's")
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="activation dtype (auto: float32 on CPU, the checkpoint's on Metal)",
    )
    g.add_argument(
        "--max-model-len",
        type=human_int,
        default=None,
        help="context length, e.g. 4096 or 8k (default: the model's, capped to fit memory)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        "--memory-fraction",
        dest="memory_fraction",
        type=float,
        default=EngineConfig.memory_fraction,
        help="fraction of the memory MLX may use for weights + KV cache",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=human_int,
        default=None,
        metavar="BYTES",
        help="size the KV cache pool to BYTES (e.g. 4G), instead of what "
        f"--gpu-memory-utilization leaves (default: ${KV_CACHE_SPACE_ENV} GiB if set)",
    )
    g.add_argument(
        "--kv-cache-disk-dir",
        default=None,
        metavar="DIR",
        help="keep computed KV blocks in files in DIR, across evictions and restarts "
        "(`serve`'s default: ~/.cache/mlxserve/kv-cache; elsewhere off)",
    )
    g.add_argument(
        "--kv-cache-disk-bytes",
        type=human_int,
        default=None,
        metavar="BYTES",
        help=f"the disk tier's size, every model's blocks together (default with `serve` "
        f"or --kv-cache-disk-dir: {DEFAULT_DISK_BYTES // 2**30}G); 0: off",
    )
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step, prefill chunks + decodes (default 2048; `serve` on "
        "the CPU: 32, so a long prompt does not stall the decoding streams)",
    )
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    g.add_argument(
        "--kv-cache-dtype",
        default=EngineConfig.kv_cache_dtype,
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="KV cache storage: auto (the activation dtype) or int8 (8-bit values with a "
        "scale per token and KV head: about 2x the tokens of a float16 cache, 3.8x float32)",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.async_scheduling,
        help="schedule and launch each step before the previous step's tokens reach the "
        "host, so the engine's Python overlaps the compute (steps that need those tokens "
        "on the host, e.g. penalties or structured outputs, run in order)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,  # unset: EngineConfig's 0, and `run` can say no flag was given
        help=f"random seed (default {EngineConfig.seed})",
    )
    g.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one"
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as a JSON object, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\'',
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many processes (started here on 127.0.0.1, or by "
        "mlx.launch); llama-family models whose head counts it divides",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="split the model's layers over this many processes (started here on 127.0.0.1, "
        "or by mlx.launch); llama-family models; not with --tensor-parallel-size",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="1 for now (not implemented; see --tensor-parallel-size)",
    )
    g.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=EngineConfig.distributed_timeout_seconds,
        help="tensor / pipeline parallel: a step that makes no progress this long means a "
        "rank is stuck; the ranks are stopped and requests fail",
    )
    add_no_effect_flags(parser, ENGINE_FLAGS)


def engine_config(
    args: argparse.Namespace, model: str | None, disk_default: bool = False
) -> EngineConfig:
    """EngineConfig from parsed flags; vLLM flags with no effect here are warned about.
    ``disk_default``: the KV disk tier is on unless the flags say otherwise (`serve`)."""
    warn_no_effect(args, ENGINE_FLAGS)
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "model"}
    if values.get("kv_cache_memory_bytes") is None:  # keep the environment's default
        values.pop("kv_cache_memory_bytes", None)
    if values.get("seed") is None:
        values.pop("seed", None)
    disk_dir = values.pop("kv_cache_disk_dir", None)
    disk_bytes = values.pop("kv_cache_disk_bytes", None)
    if disk_bytes is None and (disk_default or disk_dir):  # a folder alone means "on"
        disk_bytes = DEFAULT_DISK_BYTES
    if disk_bytes and disk_dir is None:
        disk_dir = str(user_cache_dir() / "kv-cache")
    values["kv_cache_disk_dir"], values["kv_cache_disk_bytes"] = disk_dir, disk_bytes or 0
    if args.chat_template and os.path.isfile(args.chat_template):
        with open(args.chat_template, encoding="utf-8") as f:
            values["chat_template"] = f.read()
    return EngineConfig(model=model, **values)
