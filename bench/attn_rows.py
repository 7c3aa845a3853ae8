"""CPU time of the paged-attention primitive for 1/5/9 rows of one sequence and a prefill chunk.

Run: MLXSERVE_CPU_THREADS=1 python -m bench.attn_rows [--context 1500] [--chunk 512]
Rows of one request (one block table, consecutive positions) as the engine makes them for
speculative verification and prefill chunks; SmolLM2-135M's shape (9 heads, 3 KV heads,
head size 64), float32 and int8 pools. Prints milliseconds of process CPU time per call.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from mlxserve.cpu import kernels as cpu
from mlxserve.ops import kv_quant

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _pools(blocks: int, int8: bool) -> tuple[mx.array, mx.array]:
    """Random K and V pools, float32 or int8 rows with their scales."""
    rng = np.random.default_rng(0)
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k = mx.array(rng.standard_normal(shape).astype(np.float32))
    v = mx.array(rng.standard_normal(shape).astype(np.float32))
    if int8:
        k, v = kv_quant.quantize(k), kv_quant.quantize(v)
    mx.eval(k, v)
    return k, v


def time_rows(module, k, v, rows: int, context: int, repeat: int) -> float:
    """Milliseconds of CPU time per call for `rows` rows ending at position `context`."""
    blocks = -(-context // BLOCK)
    table = np.tile(np.arange(blocks, dtype=np.int32), (rows, 1))
    ctx = np.arange(context - rows + 1, context + 1, dtype=np.int32)
    q = mx.array(np.random.default_rng(1).standard_normal((rows, HEADS, HEAD_DIM)), mx.float32)
    args = (q, k, v, mx.array(table), mx.array(ctx), rows, HEAD_DIM**-0.5)
    mx.eval(module.paged_attention(*args))
    start = time.process_time()
    for _ in range(repeat):
        mx.eval(module.paged_attention(*args))
    return (time.process_time() - start) / repeat * 1e3


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    a = parser.parse_args()
    module = cpu.module()
    for int8 in (False, True):
        k, v = _pools(-(-max(a.context, a.chunk) // BLOCK), int8)
        name = "int8" if int8 else "float32"
        for rows in (1, 5, 9):
            ms = time_rows(module, k, v, rows, a.context, a.repeat)
            print(f"{name:8} {rows:4} rows at {a.context}: {ms:8.3f} ms")
        ms = time_rows(module, k, v, a.chunk, a.chunk, max(1, a.repeat // 10))
        print(f"{name:8} prefill chunk of {a.chunk}: {ms:8.3f} ms")


if __name__ == "__main__":
    main()
