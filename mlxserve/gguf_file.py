"""A GGUF file's header -- metadata and tensor directory -- read without trusting it.

Layout (little-endian, versions 2 and 3)::

    "GGUF" | version u32 | num_tensors u64 | num_kv u64
    num_kv x (key: string, type: u32, value)         string = u64 length + UTF-8 bytes
    num_tensors x (name: string, num_dims u32, dims u64 x num_dims (ne0 first),
                   type u32, offset u64)             offset from the data section
    padding to general.alignment (default 32) | tensor data

Every read is bounds-checked and every tensor's data range is checked against the file
size, so a truncated or corrupt file is a ValueError naming the file, never a crash in a
C++ reader that trusts the header.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# Value type code -> (struct format, numpy dtype) of fixed-size scalars; 7 is bool.
_SCALARS = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_BOOL, _STRING, _ARRAY = 7, 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its type, numpy-order shape and byte range in the file."""

    name: str
    qtype: QT
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix
    offset: int  # absolute, in bytes
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (plain Python values) and the tensor directory of a GGUF file."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    """Little-endian reads over a memory map; running off the end is a ValueError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: corrupt or truncated GGUF file: {what}")

    def take(self, n: int) -> int:
        """Advance over n bytes; the position before."""
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{n} bytes needed at byte {self.pos}, file has {len(self.buf)}")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def value(self, type_code: int) -> Any:
        if type_code == _STRING:
            return self.string()
        if type_code in _SCALARS:
            return self.scalar(_SCALARS[type_code][0])
        if type_code != _ARRAY:
            raise self.fail(f"unknown metadata value type {type_code} at byte {self.pos}")
        elem_type, count = self.scalar("<I"), self.scalar("<Q")
        if elem_type in _SCALARS:
            dtype = np.dtype(_SCALARS[elem_type][1])
            if count > len(self.buf):
                raise self.fail(f"array of {count} values at byte {self.pos}")
            arr = np.frombuffer(self.buf, dtype, count, self.take(count * dtype.itemsize))
            return [bool(v) for v in arr] if elem_type == _BOOL else arr.tolist()
        if count > len(self.buf) // 8:  # every string or nested array takes >= 8 bytes
            raise self.fail(f"array of {count} values at byte {self.pos}")
        return [self.value(elem_type) for _ in range(count)]


def _tensor_info(cur: _Cursor) -> tuple[str, QT, tuple[int, ...], int]:
    name = cur.string()
    num_dims = cur.scalar("<I")
    if not 1 <= num_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name} has {num_dims} dimensions")
    dims = tuple(cur.scalar("<Q") for _ in range(num_dims))
    code = cur.scalar("<I")
    try:
        qtype = QT(code)
    except ValueError:
        raise cur.fail(f"tensor {name} has unknown type code {code}") from None
    return name, qtype, tuple(reversed(dims)), cur.scalar("<Q")


def _nbytes(name: str, qtype: QT, shape: tuple[int, ...], path: Path) -> int:
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_values or 0 in shape:
        raise ValueError(
            f"{path}: tensor {name} of type {qtype.name} has shape {shape}: rows must be a "
            f"non-empty multiple of its {block_values}-value blocks"
        )
    return math.prod(shape) // block_values * block_bytes  # Python ints: no overflow


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap]:
    """The file memory-mapped read-only; unreadable or empty files are a ValueError."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file ({e})") from None
    except ValueError:  # mmap of an empty file
        raise ValueError(f"{path}: not a GGUF file (it is empty)") from None
    try:
        yield buf
    finally:
        buf.close()


def _read_metadata(cur: _Cursor) -> tuple[int, dict[str, Any]]:
    """Magic, version, counts and the key/values: (number of tensors, metadata)."""
    magic = bytes(cur.buf[:4])
    if magic != GGUF_MAGIC:
        raise ValueError(f"{cur.path}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
    cur.take(4)
    version = cur.scalar("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{cur.path}: GGUF version {version} is not supported (supported: 2, 3)")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if num_tensors > len(cur.buf) // 24 or num_kv > len(cur.buf) // 12:  # minimum entry sizes
        raise cur.fail(f"header claims {num_tensors} tensors and {num_kv} metadata keys")
    meta: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    return num_tensors, meta


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the metadata key/values, as plain Python values (the tensor directory is skipped)."""
    path = Path(path)
    with _mapped(path) as buf:
        return _read_metadata(_Cursor(buf, path))[1]


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and check a GGUF file's metadata and tensor directory (tensor data not read)."""
    with _mapped(path) as buf:
        cur = _Cursor(buf, path)
        num_tensors, meta = _read_metadata(cur)
        infos = [_tensor_info(cur) for _ in range(num_tensors)]
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        tensors = []
        for name, qtype, shape, offset in infos:
            nbytes = _nbytes(name, qtype, shape, path)
            if data_start + offset + nbytes > len(buf):
                raise cur.fail(
                    f"tensor {name} ends at byte {data_start + offset + nbytes}, past the end "
                    f"of the file ({len(buf)} bytes): an incomplete download?"
                )
            tensors.append(TensorInfo(name, qtype, shape, data_start + offset, nbytes))
        return GGUFHeader(meta, tensors)


def read_tensor_bytes(path: Path, info: TensorInfo) -> np.ndarray:  # (rows..., row_bytes) u8
    """A tensor's raw bytes (memory-mapped, read-only), one row per matrix row."""
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    return data.reshape(*info.shape[:-1], -1)
