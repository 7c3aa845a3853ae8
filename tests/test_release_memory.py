"""Memory nothing holds any more goes back to the OS after start-up (utils.release_free_memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxserve import LLM
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT


def test_an_engine_keeps_no_freed_buffers_after_start_up(tmp_path: Path) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    junk = mx.ones((1 << 20,))  # 4 MiB freed just before: MLX caches it
    mx.eval(junk)
    del junk
    assert mx.get_cache_memory() > 0
    llm = LLM(str(model_dir), num_blocks=64)
    try:
        assert mx.get_cache_memory() == 0
    finally:
        llm.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_freed_heap_pages_leave_the_resident_set() -> None:
    # 160 MiB in 64 KiB blocks (below glibc's mmap threshold: they come from the heap),
    # freed in an order that leaves the heap's top in use, so free() alone keeps them.
    script = """
import ctypes, sys
from mlxserve.utils import release_free_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
blocks = [libc.malloc(64 << 10) for _ in range(2560)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
release_free_memory()
print(before - rss())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    released_mib = int(out.stdout.strip()) / 1024
    assert released_mib > 120


def test_a_growing_kv_pool_is_never_resident_twice(tmp_path: Path) -> None:
    from mlxserve.loader import load_model
    from mlxserve.worker.model_runner import ModelRunner

    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    loaded = load_model(str(model_dir))
    runner = ModelRunner(loaded.model, dtype=loaded.dtype, block_size=16)
    runner.ensure_blocks(2048)
    mx.eval(runner.kv_cache.arrays())
    old = mx.get_active_memory()
    mx.clear_cache()
    mx.reset_peak_memory()
    runner.ensure_blocks(4096)
    mx.eval(runner.kv_cache.arrays())
    arrays = runner.kv_cache.arrays()
    pool = sum(a.nbytes for a in arrays)
    assert runner.num_blocks == 4096 and pool >= 16 * 2**20
    # Each array is copied once the one before it is: at most one array's old and new
    # copies overlap (evaluated all at once, most of the old pool stayed beside the new).
    assert mx.get_peak_memory() <= old + pool // 2 + max(a.nbytes for a in arrays) + 2**20
