"""The one workload every `mlxserve bench` sub-command measures with.

Prompts are token ids cut from one passage (:func:`make_prompts`), so every engine (and
every peer, fed the same ids or their text) computes the same tokens; requests are greedy
with ``ignore_eos``, so each makes exactly its tokens.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any

PASSAGE = (
    "The river starts high in the mountains, where snow melts in the spring and feeds small "
    "streams that join into one. It runs past farms and old stone bridges, through a town "
    "with a market on Saturdays, and on to the sea. Along the way it turns mills, waters "
    "fields, and carries boats loaded with wood, grain and wool. People have lived beside "
    "it for thousands of years, and many stories are told about its floods and its fish. "
)


@dataclass(frozen=True)
class OfflineSpec:
    """What the offline runs measure; defaults are the suite's (bench/README.md)."""

    prompt_tokens: int = 32  # prompts of the decode and batch runs
    decode_tokens: int = 128
    prefill_tokens: int = 512
    batch_sizes: tuple[int, ...] = (8, 32)
    batch_tokens: int = 32
    profile_batch: int = 32
    profile_steps: int = 16


def device_info() -> dict[str, object]:
    """Where the numbers come from: machine, MLX device and version, BLAS, CPU kernels."""
    import mlx.core as mx

    from mlxserve.cpu import blas, kernels
    from mlxserve.utils import uses_gpu

    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal": bool(mx.metal.is_available()),
        "blas": blas.blas_status(),
        # Built on first use; only meaningful (and only consulted by the loader) on the CPU.
        "cpu_kernels": None if uses_gpu() else kernels.status(),
    }


def conditions() -> dict[str, object]:
    """Load on the machine when the run starts (shared machines make noise)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"loadavg": load, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def make_prompts(tokenizer: Any, count: int, num_tokens: int, start: int = 0) -> list[list[int]]:
    """``count`` prompts of exactly ``num_tokens`` ids; they differ from their first block.

    Each starts with its own number, so no two share a prefix-cache block.
    """
    body = tokenizer.encode(PASSAGE * (num_tokens // 40 + 2), add_special_tokens=False)
    out = []
    for i in range(start, start + count):
        head = tokenizer.encode(f"Note {i * 7919 % 100000}: ", add_special_tokens=False)
        ids = (head + body[i % 17 :])[:num_tokens]
        assert len(ids) == num_tokens, (len(ids), num_tokens)
        out.append(ids)
    return out


def text_prompts(tokenizer: Any, count: int, num_tokens: int, start: int) -> list[str]:
    """:func:`make_prompts` as text, for servers (each tokenizes it back to ~``num_tokens``)."""
    return [tokenizer.decode(ids) for ids in make_prompts(tokenizer, count, num_tokens, start)]


def load_tokenizer(model: str | None) -> Any:
    """MODEL's tokenizer alone (no weights): for prompts sent to a server."""
    from mlxserve.loader import resolve_model
    from mlxserve.tokenizer import Tokenizer

    source = resolve_model(model)
    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    return Tokenizer.from_dir(source.path)


def greedy(max_tokens: int) -> Any:
    """Sampling of every bench request: greedy, exactly ``max_tokens`` tokens."""
    from mlxserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(model: str | None, **engine_args: Any) -> Any:
    from mlxserve.config import EngineConfig
    from mlxserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **engine_args))


def timed_generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Run prompts to completion on ``engine``; wall time, first-token and end times."""
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", None, greedy(max_tokens), prompt_token_ids=ids)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    end = time.perf_counter()
    return {
        "wall_s": end - t0,
        "first_token_s": min(first.values()) - t0,
        "last_first_token_s": max(first.values()) - t0,
        "output_tokens": tokens,
    }
