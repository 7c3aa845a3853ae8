"""KV memory: bytes per token, and how many requests fit a fixed KV budget.

mlxserve: a block pool; a request holds ceil(tokens / block_size) blocks, and requests
with a common prefix share its full blocks. mlx-lm's batched generation keeps one
contiguous (batch, heads, length, head_dim) cache per layer whose length is the longest
request's, grown in steps of 256 tokens (its KVCache.step); the single-request sizes the
mlx-lm worker measures confirm the step.
"""

from __future__ import annotations

import random

MLX_LM_STEP = 256


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_size


def workload(count: int, seed: int = 0) -> list[int]:
    """Request lengths (prompt + output tokens): prompts 64..2048, 256 output tokens."""
    rng = random.Random(seed)
    return [rng.randint(64, 2048) + 256 for _ in range(count)]


def fit_mlxserve(
    lengths: list[int], budget_tokens: int, block_size: int, shared_prefix: int = 0
) -> int:
    """Requests admitted in order until the pool's blocks run out."""
    shared_blocks = shared_prefix // block_size
    used = shared_blocks
    for i, n in enumerate(lengths):
        need = -(-(n + shared_prefix) // block_size) - shared_blocks
        if used + need > budget_tokens // block_size:
            return i
        used += need
    return len(lengths)


def fit_mlx_lm(lengths: list[int], budget_tokens: int, shared_prefix: int = 0) -> int:
    """Largest batch (in order) whose padded contiguous cache fits."""
    longest = 0
    for i, n in enumerate(lengths):
        longest = max(longest, n + shared_prefix)
        padded = -(-longest // MLX_LM_STEP) * MLX_LM_STEP
        if (i + 1) * padded > budget_tokens:
            return i
    return len(lengths)


def analyze(bytes_per_token: int, block_size: int, budget_bytes: int) -> dict[str, object]:
    lengths = workload(512)
    budget_tokens = budget_bytes // bytes_per_token
    out: dict[str, object] = {
        "kv_bytes_per_token": bytes_per_token,
        "budget_bytes": budget_bytes,
        "budget_tokens": budget_tokens,
        "workload": "prompt 64..2048 (uniform) + 256 output tokens",
    }
    for label, prefix in (("distinct", 0), ("shared_1024_prefix", 1024)):
        out[label] = {
            "mlxserve": fit_mlxserve(lengths, budget_tokens, block_size, prefix),
            "mlx_lm": fit_mlx_lm(lengths, budget_tokens, prefix),
        }
    return out
