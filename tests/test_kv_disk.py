"""The prefix cache's disk tier (engine/kv_disk.py): blocks kept in files survive the engine
that computed them, come back exactly, and a file that does not check out is recomputed.

Oracle: the same engine without a disk tier (batch invariance: a prompt's tokens do not
depend on which of its blocks were cached), and hand-counted blocks.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import start_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=21)[1]


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def engine(model_dir: Path, disk: Path | None, **kwargs) -> LLM:
    disk_args = {"kv_cache_disk_dir": str(disk), "kv_cache_disk_bytes": 1 << 30} if disk else {}
    return LLM(str(model_dir), num_blocks=400, block_size=BLOCK, **disk_args, **kwargs)


def run(llm: LLM, tokens: list[int]):
    (out,) = llm.generate([tokens], GREEDY, use_tqdm=False)
    return out


def files(disk: Path) -> list[Path]:
    return sorted(disk.glob("*/*/*.kv"))


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": "float32"}, {"dtype": "bfloat16"}, {"dtype": "float32", "kv_cache_dtype": "int8"}],
    ids=["float32", "bfloat16", "int8-kv"],
)
def test_a_restarted_engine_reads_the_prefix_from_disk_exactly(tiny, tmp_path, kwargs) -> None:
    disk = tmp_path / "kv"
    first = engine(tiny, disk, **kwargs)
    run(first, prompt(100))
    first.shutdown()  # the pending blocks are written before it returns
    # 100 prompt tokens + 7 of 8 outputs computed: 6 full blocks.
    assert len(files(disk)) == 6
    del first

    follow_up = prompt(100) + [7, 8, 9]
    again = engine(tiny, disk, **kwargs)  # a new process's engine: an empty pool
    out = run(again, follow_up)
    assert out.num_cached_tokens == 96  # every full block of the shared 100 tokens
    stats = again.engine.cache_stats()
    pool, on_disk = stats.tiers
    assert (pool.hit_tokens, on_disk.name, on_disk.hit_tokens) == (0, "disk", 96)
    want = run(engine(tiny, None, **kwargs), follow_up)  # no disk tier: all computed
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_torn_or_corrupt_file_is_recomputed_not_read(tiny, tmp_path) -> None:
    disk = tmp_path / "kv"
    first = engine(tiny, disk)
    run(first, prompt(100, seed=1))
    first.shutdown()
    paths = files(disk)
    assert len(paths) == 6
    data = bytearray(paths[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit in the K/V: the checksum fails
    paths[0].write_bytes(bytes(data))
    paths[1].write_bytes(paths[1].read_bytes()[:-100])  # torn: cut short
    again = engine(tiny, disk)
    out = run(again, prompt(100, seed=1) + [5])
    # The chain stops at the first spoiled block (its place in the prompt is unknown here).
    assert out.num_cached_tokens % BLOCK == 0 and out.num_cached_tokens < 96
    want = run(engine(tiny, None), prompt(100, seed=1) + [5])
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    # The spoiled blocks were computed again and kept anew: a third engine reads them all.
    again.shutdown()
    third = engine(tiny, disk)
    assert run(third, prompt(100, seed=1) + [6]).num_cached_tokens == 96


def test_another_model_never_reads_these_blocks(tiny, tmp_path) -> None:
    disk = tmp_path / "kv"
    first = engine(tiny, disk)
    run(first, prompt(100, seed=2))
    first.shutdown()
    other_dir = make_tiny_model_dir(tmp_path / "other", seed=22)[1]
    other = engine(other_dir, disk)
    assert run(other, prompt(100, seed=2) + [5]).num_cached_tokens == 0
    other.shutdown()
    assert len(files(disk)) == 12  # both models' blocks, in two folders


def test_the_folder_stays_under_its_budget_least_recently_used_first(tiny, tmp_path) -> None:
    disk = tmp_path / "kv"
    probe = engine(tiny, disk)
    run(probe, prompt(40, seed=3))  # 2 full blocks (40 + 7 computed tokens)
    probe.shutdown()
    size = files(disk)[0].stat().st_size
    budget = 5 * size + size // 2  # room for 5 files
    small = LLM(
        str(tiny), num_blocks=400, block_size=BLOCK, kv_cache_disk_dir=str(disk),
        kv_cache_disk_bytes=budget,
    )  # fmt: skip
    run(small, prompt(100, seed=4))  # 6 more blocks
    small.shutdown()
    assert len(files(disk)) == 5
    assert sum(p.stat().st_size for p in files(disk)) <= budget


def test_a_server_restart_keeps_the_sessions_prefix(tiny, tmp_path) -> None:
    disk = tmp_path / "kv"
    args = [str(tiny), "--served-model-name", "tiny", "--dtype", "float32"]
    args += ["--kv-cache-disk-dir", str(disk), "--kv-cache-disk-bytes", "1G"]
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 6}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    server = start_server(args, tmp_path / "first.log")
    try:
        first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    finally:
        server.stop()  # SIGTERM: the engine writes its pending blocks before it exits
    prompt_tokens = first["usage"]["prompt_tokens"]
    server = start_server(args, tmp_path / "second.log")
    try:
        turn = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        body["messages"] = [*messages, turn, {"role": "user", "content": "Again."}]
        second = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        stats = httpx.get(server.url + "/cache/stats", timeout=10).json()["data"][0]
    finally:
        server.stop()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt_tokens // BLOCK * BLOCK - BLOCK  # the first turn's full blocks
    assert stats["tiers"][1]["name"] == "disk" and stats["tiers"][1]["hit_tokens"] == cached


def test_serve_keeps_blocks_in_the_users_cache_unless_told_not_to(monkeypatch, tmp_path) -> None:
    from mlxserve.cli.engine_args import engine_config
    from mlxserve.cli.main import build_parser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parse = build_parser().parse_args
    serve = engine_config(parse(["serve"]), None, disk_default=True)
    assert serve.kv_cache_disk_dir == str(tmp_path / "mlxserve" / "kv-cache")
    assert serve.kv_cache_disk_bytes == 4 * 2**30
    off = engine_config(parse(["serve", "--kv-cache-disk-bytes", "0"]), None, disk_default=True)
    assert off.kv_cache_disk_bytes == 0
    elsewhere = engine_config(parse(["serve", "--kv-cache-disk-dir", "/x"]), None, True)
    assert (elsewhere.kv_cache_disk_dir, elsewhere.kv_cache_disk_bytes) == ("/x", 4 * 2**30)
    run = engine_config(parse(["run"]), None)  # a chat in the terminal keeps nothing
    assert run.kv_cache_disk_bytes == 0
    asked = engine_config(parse(["run", "--kv-cache-disk-dir", "/y"]), None)  # unless told
    assert (asked.kv_cache_disk_dir, asked.kv_cache_disk_bytes) == ("/y", 4 * 2**30)


def test_a_full_disk_stops_the_writes_with_one_warning(tiny, tmp_path, monkeypatch, caplog) -> None:
    import errno

    from mlxserve.engine import kv_disk

    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(kv_disk, "open", full_disk, raising=False)
    llm = engine(tiny, tmp_path / "kv")
    run(llm, prompt(100, seed=5))
    llm.shutdown()
    run(llm, prompt(100, seed=6))  # the engine goes on serving
    llm.shutdown()
    warnings = [r for r in caplog.records if "stopped writing" in r.message]
    assert len(warnings) == 1 and "No space left" in warnings[0].message
    assert files(tmp_path / "kv") == [] and not list((tmp_path / "kv").glob("*/*/*.tmp*"))


WRITER = """
import sys
import numpy as np
from pathlib import Path
from mlxserve.engine.kv_disk import DiskBlockStore
from mlxserve.worker.kv_transfer import StoredBlock
store = DiskBlockStore(Path(sys.argv[1]), "shared-model", 1 << 30)
for i in range(60):  # both processes write the same blocks at the same time
    data = np.full((16, 2, 8), i, dtype=np.float32)
    store.put(bytes([i]) * 32, (i,) * 16, StoredBlock((data, data), ("float32", "float32")))
store.flush()
"""


def test_two_servers_sharing_a_folder_never_leave_a_spoiled_file(tmp_path) -> None:
    import subprocess
    import sys

    from mlxserve.engine.kv_disk import DiskBlockStore
    from tests.paths import ROOT

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env, cwd=ROOT)
        for _ in range(2)
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    reader = DiskBlockStore(tmp_path, "shared-model", 1 << 30)
    for i in range(60):
        block = reader.load(bytes([i]) * 32, (i,) * 16)
        assert block is not None and float(block.arrays[1][0, 0, 0]) == i
    assert reader.num_invalid == 0 and not list(tmp_path.glob("*/*/*.tmp*"))


def test_shutdown_writes_what_is_queued_and_ends_the_writer_thread(tiny, tmp_path) -> None:
    """A server that unloads a model shuts its engine down: the disk tier's thread ends."""
    llm = engine(tiny, tmp_path / "kv", dtype="float32")
    run(llm, prompt(100))
    store = llm.engine.kv_store
    assert store is not None and store._writer.is_alive()
    llm.shutdown()
    assert not store._writer.is_alive() and len(files(tmp_path / "kv")) == 6
    llm.shutdown()  # twice is harmless


def test_a_waiting_request_reads_its_stored_blocks_once() -> None:
    from mlxserve.core.kv_cache_manager import KVCacheManager
    from mlxserve.core.request import Request

    class Store:
        def __init__(self) -> None:
            self.reads = 0

        def load(self, block_hash, token_ids):
            self.reads += 1
            return ("block", token_ids)

    kv = KVCacheManager(block_size=4, num_blocks=4)  # 3 usable blocks
    kv.store = store = Store()
    req = Request("r", list(range(1, 18)), SamplingParams(max_tokens=1))  # 4 full blocks
    hit, num_hit = kv.get_computed_blocks(req)
    stored = kv.load_stored_blocks(req, num_hit)
    assert (num_hit, len(stored), store.reads) == (0, 4, 4)
    assert kv.allocate_slots(req, req.num_tokens, hit, 16) is None  # no room yet
    assert kv.load_stored_blocks(req, num_hit) == stored and store.reads == 4  # not re-read
    kv.free(req)  # aborted while it waited: another read is a fresh one
    kv.load_stored_blocks(req, num_hit)
    assert store.reads == 8
