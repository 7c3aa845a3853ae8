"""Read the key/value metadata of a GGUF file without touching its tensors."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# GGUF value type codes -> (struct format, numpy dtype) for fixed-size scalars.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),  # UINT8
    1: ("<b", "<i1"),  # INT8
    2: ("<H", "<u2"),  # UINT16
    3: ("<h", "<i2"),  # INT16
    4: ("<I", "<u4"),  # UINT32
    5: ("<i", "<i4"),  # INT32
    6: ("<f", "<f4"),  # FLOAT32
    7: ("<?", "<u1"),  # BOOL
    10: ("<Q", "<u8"),  # UINT64
    11: ("<q", "<i8"),  # INT64
    12: ("<d", "<f8"),  # FLOAT64
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9
_TYPE_BOOL = 7


class _Cursor:
    """Little-endian reader over a memory map that reports truncation as ValueError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF metadata at byte {self.pos}")

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, type_code: int) -> Any:
        if type_code == _TYPE_STRING:
            return self.string()
        if type_code == _TYPE_ARRAY:
            elem_type = self.scalar("<I")
            count = self.scalar("<Q")
            if elem_type == _TYPE_STRING:
                return [self.string() for _ in range(count)]
            if elem_type in _SCALAR_TYPES:
                dtype = np.dtype(_SCALAR_TYPES[elem_type][1])
                self.need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                out = arr.tolist()
                return [bool(v) for v in out] if elem_type == _TYPE_BOOL else out
            return [self.value(elem_type) for _ in range(count)]  # nested arrays
        if type_code in _SCALAR_TYPES:
            return self.scalar(_SCALAR_TYPES[type_code][0])
        raise ValueError(f"{self.path}: unknown GGUF value type {type_code} at byte {self.pos}")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file as plain Python values (str, int, float, bool, list).

    Only the header is parsed (tensor data is never read), so this is cheap even for large models.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ValueError(f"{path}: cannot open GGUF file: {e}") from e
    except ValueError as e:  # mmap of an empty file
        raise ValueError(f"{path}: not a GGUF file (empty)") from e
    try:
        cur = _Cursor(buf, path)
        cur.need(4)
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"{path}: GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})"
            )
        cur.scalar("<Q")  # tensor count (unused)
        num_kv = cur.scalar("<Q")
        meta: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        return meta
    finally:
        buf.close()
