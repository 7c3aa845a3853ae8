"""openai-harmony (OpenAI's reference renderer and parser of the harmony format) as a test
oracle, offline.

openai-harmony loads the o200k_base vocabulary from the network (and checks its SHA-256);
the quicktok-v1 package ships the same vocabulary in a binary form, from which the
.tiktoken file is rebuilt into a temporary directory (the hash check proves it exact).
"""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path

import pytest

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def write_o200k_tiktoken(directory: Path) -> Path:
    """o200k_base.tiktoken (base64 token, rank per line) from quicktok's o200k.vocab:
    u32 count, then per token u16 length, the bytes and a u32 rank."""
    quicktok = pytest.importorskip("quicktok")
    data = (Path(quicktok.__file__).parent / "data" / "o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    pos, ranked = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2 : pos + 2 + length]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + length)
        ranked.append((rank, token))
        pos += 6 + length
    lines = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in sorted(ranked))
    path = directory / "o200k_base.tiktoken"
    path.write_text(lines)
    return path


def load_encoding(directory: Path):
    """openai-harmony's gpt-oss encoding, its vocabulary read from ``directory``."""
    harmony = pytest.importorskip("openai_harmony")
    write_o200k_tiktoken(directory)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
