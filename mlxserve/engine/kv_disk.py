"""The prefix cache's disk tier: full KV blocks kept in files, across evictions and restarts.

A block computed once is written here (off the step path, by a writer thread) under its
prefix-cache hash, the chained SHA-256 of every token up to its end, in a folder named by
the model's fingerprint; a later prompt whose blocks leave the pool's cache finds them
here, and the scheduler loads them into pool blocks instead of computing them.

    <dir>/<fingerprint>/<hash[:2]>/<hash>.kv

A file is a header (magic, format version, the fingerprint, the block's hash and token
ids, each array's dtype and shape), the arrays' bytes, and a CRC-32 of everything before
it. It is written to a temporary name and renamed, so a reader sees a whole file or none.
A file that is short, fails its checksum, names another model or other tokens is ignored
(and removed): the block is computed instead, never taken wrong. The folder is kept under
a byte budget, least recently used files removed first.

The fingerprint covers what makes a block's bytes: the model's files (names, sizes, times),
its dtype, the KV dtype, the block size, every pool array's shape, the CPU backend's
settings and mlxserve's version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from mlxserve import settings
from mlxserve.config import EngineConfig
from mlxserve.kv_cache_spec import KVCacheLayout
from mlxserve.loader import LoadedModel
from mlxserve.worker.kv_transfer import StoredBlock

logger = logging.getLogger("mlxserve")

MAGIC = b"MLXSKV01"
_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
STALE_TMP_S = 600  # a temporary file this old was left by a crash, not a write under way
QUEUE_BLOCKS = 4096  # blocks waiting to be written; more are dropped (counted), not queued


def fingerprint(facts: dict) -> str:
    """A folder name for everything that makes a block's bytes (``facts`` is JSON-able)."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_file_facts(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of a model's weight files: a file or a folder's weights."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".npz", ".bin")
    )  # fmt: skip
    out = []
    for p in files:
        st = p.stat()
        out.append((p.name, st.st_size, st.st_mtime_ns))
    return out


def open_disk_tier(
    config: EngineConfig,
    loaded: LoadedModel,
    layout: KVCacheLayout,
    kv_dtype: object,
    *,
    prefix_caching_off: str | None,
    parallel: bool,
    drafter: bool,
) -> DiskBlockStore | None:
    """The disk tier of an engine, where its config asks for one and it can work (either
    way the log says so)."""
    if not (config.kv_cache_disk_bytes and config.kv_cache_disk_dir):
        return None
    why = None
    if prefix_caching_off is not None:
        why = "prefix caching is off"
    elif parallel:
        why = "tensor and pipeline parallel keep their pools on several ranks"
    elif layout.has_state or layout.num_groups != 1 or layout.groups[0].window is not None:
        why = "only models whose layers all attend fully (no windows, no recurrent state)"
    elif drafter:
        why = "a draft model or MTP layer keeps a second pool"
    if why is not None:
        logger.info("KV disk cache: off (%s)", why)
        return None
    source = loaded.source
    facts = {
        "format": 1,
        "mlxserve": _version(),
        "model": [source.kind, str(source.path.resolve()), model_file_facts(source.path)],
        "dtype": str(loaded.dtype),
        "kv_dtype": str(kv_dtype),
        "block_size": config.block_size,
        "tensors": layout.tensor_shapes,
        "settings": settings.describe(),
    }
    store = DiskBlockStore(
        Path(config.kv_cache_disk_dir), fingerprint(facts), config.kv_cache_disk_bytes
    )
    logger.info(
        "KV disk cache: %s (%d blocks kept; %.1f GiB for every model in %s)",
        store.folder.name, store.num_blocks, store.budget / 2**30, config.kv_cache_disk_dir,
    )  # fmt: skip
    return store


def _version() -> str:
    try:
        return importlib.metadata.version("mlxserve")
    except importlib.metadata.PackageNotFoundError:  # run from a clone, not installed
        return "unknown"


class DiskBlockStore:
    """Blocks on disk by hash, under ``budget`` bytes; thread-safe."""

    def __init__(self, root: Path, model_fingerprint: str, budget: int) -> None:
        assert budget > 0, budget
        self.fingerprint = model_fingerprint
        self.folder = Path(root) / model_fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._lock = threading.Lock()
        # every block file under root -> its size; least recently used first (the whole
        # root shares the budget: other models' folders count and are evicted too).
        self._files: OrderedDict[Path, int] = OrderedDict()
        self._bytes = 0
        self._own = [0, 0]  # this model's files and bytes (for stats, read every step)
        self.num_invalid = 0  # files ignored: torn, corrupt, another model's or tokens
        self.stopped: str | None = None  # why writing stopped (a full disk), if it did
        self._scan(Path(root))
        self._queue: queue.Queue = queue.Queue(QUEUE_BLOCKS)
        self._is_closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ index
    def _scan(self, root: Path) -> None:
        """Index every block file under ``root`` by modification time (LRU order)."""
        found = []
        for path in root.glob("*/*/*.kv"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, path, st.st_size))
        for _, path, size in sorted(found):
            self._add(path, size)
        stale = time.time() - STALE_TMP_S
        for path in root.glob("*/*/*.tmp*"):  # a write a crash cut short (not one under way)
            try:
                if path.stat().st_mtime < stale:
                    path.unlink(missing_ok=True)
            except OSError:
                pass
        self._evict_over_budget()

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.folder / name[:2] / f"{name}.kv"

    def _evict_over_budget(self) -> None:
        while self._bytes > self.budget and self._files:
            path = next(iter(self._files))
            self._drop(path)
            path.unlink(missing_ok=True)

    def _add(self, path: Path, size: int) -> None:
        """Index a file as the most recently used (replacing its old entry); lock held."""
        self._drop(path)
        self._files[path] = size
        self._bytes += size
        if path.parent.parent == self.folder:
            self._own[0] += 1
            self._own[1] += size

    def _drop(self, path: Path) -> None:
        """Forget a file's entry (not the file); lock held."""
        size = self._files.pop(path, None)
        if size is None:
            return
        self._bytes -= size
        if path.parent.parent == self.folder:
            self._own[0] -= 1
            self._own[1] -= size

    @property
    def num_blocks(self) -> int:
        """This model's files."""
        return self._own[0]

    @property
    def num_bytes(self) -> int:
        """This model's files' bytes."""
        return self._own[1]

    # ------------------------------------------------------------------ write
    def put(self, block_hash: bytes, token_ids: tuple[int, ...], block: StoredBlock) -> None:
        """Queue a block for writing (returns at once; a full queue drops it). A block
        computed again replaces its file: the chain that led to computing it broke
        earlier, and this file may be what broke a later one."""
        if self.stopped or self._is_closed:
            return
        try:
            self._queue.put_nowait((block_hash, token_ids, block))
        except queue.Full:  # the disk is behind: this block is not kept (a miss later)
            pass

    def flush(self) -> None:
        """Wait until every queued block is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread (the engine is going away: a
        server unloads a model)."""
        if self._is_closed:
            return
        self._is_closed = True  # put() queues no more
        self._queue.put(None)
        self._writer.join(timeout=60)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # close()
                self._queue.task_done()
                return
            block_hash, token_ids, block = item
            try:
                if not self.stopped:
                    self._write(block_hash, token_ids, block)
            except FileNotFoundError:  # another server sharing the folder removed a folder
                pass
            except OSError as e:  # a full disk, a removed folder: stop, once, and say so
                self.stopped = f"could not write a block ({e})"
                logger.warning(
                    "KV disk cache: stopped writing (blocks already kept are still read): %s",
                    self.stopped,
                )
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, token_ids: tuple[int, ...], block: StoredBlock) -> None:
        path = self._path(block_hash)
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "hash": block_hash.hex(),
                "tokens": list(token_ids),
                "arrays": [
                    [d, list(a.shape)] for d, a in zip(block.dtypes, block.arrays, strict=True)
                ],
            }
        ).encode()
        body = MAGIC + _LEN.pack(len(header)) + header + b"".join(a.tobytes() for a in block.arrays)
        data = body + _CRC.pack(zlib.crc32(body))
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unique per process and thread: servers sharing the folder never share a file
        # half-written; the rename makes a whole file appear at once.
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._add(path, len(data))
            self._evict_over_budget()

    # ------------------------------------------------------------------ read
    def load(self, block_hash: bytes, token_ids: tuple[int, ...]) -> StoredBlock | None:
        """The block stored under ``block_hash`` for exactly ``token_ids``, or None (absent,
        or a file that does not check out: it is removed)."""
        path = self._path(block_hash)
        with self._lock:
            if path not in self._files:
                return None
            self._files.move_to_end(path)  # recently used
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # another server sharing the folder evicted it
            with self._lock:
                self._drop(path)
            return None
        except OSError:
            data = b""
        block = self._decode(data, block_hash, token_ids)
        if block is None:
            self.num_invalid += 1
            logger.warning("KV disk cache: ignored the invalid block file %s", path)
            with self._lock:
                self._drop(path)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return block

    def _decode(
        self, data: bytes, block_hash: bytes, token_ids: tuple[int, ...]
    ) -> StoredBlock | None:
        if len(data) < len(MAGIC) + _LEN.size + _CRC.size or not data.startswith(MAGIC):
            return None
        body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
        if zlib.crc32(body) != crc:
            return None
        (size,) = _LEN.unpack_from(body, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        try:
            header = json.loads(body[start : start + size])
        except ValueError:
            return None
        if (
            header.get("fingerprint") != self.fingerprint
            or header.get("hash") != block_hash.hex()
            or tuple(header.get("tokens", ())) != tuple(token_ids)
        ):
            return None
        offset, arrays, dtypes = start + size, [], []
        for dtype, shape in header["arrays"]:
            np_dtype = np.dtype("uint16" if dtype == "bfloat16" else dtype)
            count = math.prod(shape)
            end = offset + count * np_dtype.itemsize
            if end > len(body):
                return None
            arrays.append(np.frombuffer(body, np_dtype, count, offset).reshape(shape))
            dtypes.append(dtype)
            offset = end
        if offset != len(body):
            return None
        return StoredBlock(tuple(arrays), tuple(dtypes))
