"""The hub, bounded: a silent or unreachable endpoint is one clear line (or the cache), fast.

Every "hub" here is a socket on 127.0.0.1 that this test opens: one that accepts and never
answers, and a closed port that refuses. Nothing reaches the internet.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxserve.loader.hub import is_cached
from tests.paths import ROOT
from tests.test_loader_resolve import make_fake_hub

# The hub's metadata timeout in these tests (huggingface_hub's HF_HUB_ETAG_TIMEOUT).
TIMEOUT_S = 1


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """An endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:  # closed at teardown
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()
    for conn in held:
        conn.close()


@pytest.fixture
def refusing_hub() -> str:
    """An endpoint whose port refuses connections (bound, then closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def run_with_hub(endpoint: str, cache: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`mlxserve run ARGS` against ``endpoint`` with a private cache; a generous timeout
    (the bug was an endless wait) so a hang fails the test instead of stalling the suite."""
    env = dict(
        os.environ,
        HF_ENDPOINT=endpoint,
        HF_HUB_ETAG_TIMEOUT=str(TIMEOUT_S),
        HF_HOME=str(cache),
        HF_HUB_CACHE=str(cache),
    )
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run(
        [sys.executable, "-m", "mlxserve.cli", "run", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    """stderr without the "Loading ..." progress line."""
    return [line for line in out.stderr.splitlines() if not line.startswith("Loading ")]


@pytest.mark.parametrize("model", ["acme/silent", "acme/silent-GGUF/model.Q4_0.gguf"])
def test_a_hub_that_never_answers_is_one_error_line(silent_hub, tmp_path, model) -> None:
    out = run_with_hub(silent_hub, tmp_path, ["--model", model, "hi"])
    assert out.returncode == 2
    assert error_lines(out) == [
        f"error: model {model!r} is not in the local Hugging Face cache and the hub at "
        f"{silent_hub} did not answer within {TIMEOUT_S} s (HF_HUB_ETAG_TIMEOUT). Check the "
        f"network (or HF_ENDPOINT), or pass a local directory or .gguf file"
    ]


@pytest.mark.parametrize("model", ["acme/gone", "acme/gone-GGUF/model.Q4_0.gguf"])
def test_an_unreachable_hub_is_one_error_line_without_retries(
    refusing_hub, tmp_path, model
) -> None:
    """A repo's .gguf file used to cost five retries (~24 s) and 22 warning lines."""
    out = run_with_hub(refusing_hub, tmp_path, ["--model", model, "hi"])
    assert out.returncode == 2
    lines = error_lines(out)
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        f"error: model {model!r} is not in the local Hugging Face cache and the hub at "
        f"{refusing_hub} cannot be reached ("
    )
    assert "Connection refused" in lines[0]


def test_a_cached_model_is_used_when_the_hub_is_silent(silent_hub, tmp_path) -> None:
    """The cached copy serves (with one warning) instead of waiting for the hub."""
    from tests.paths import SMOLLM2_GGUF

    snapshot = make_fake_hub(tmp_path, "acme/smol-GGUF", {})
    (snapshot / "smol.gguf").symlink_to(SMOLLM2_GGUF)
    args = [
        "--model",
        "acme/smol-GGUF/smol.gguf",
        "What is the capital of France? Answer with one word.",
    ]
    out = run_with_hub(silent_hub, tmp_path, [*args, "--max-tokens", "8", "--temperature", "0"])
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert error_lines(out) == [
        f"WARNING mlxserve: the hub did not answer within {TIMEOUT_S} s (HF_HUB_ETAG_TIMEOUT): "
        "using the cached copy of acme/smol-GGUF/smol.gguf"
    ]


def test_is_cached_looks_at_the_disk_only(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub.constants as constants

    make_fake_hub(tmp_path, "acme/here", {"config.json": "{}"})
    make_fake_hub(tmp_path, "acme/here-GGUF", {"m.gguf": "x"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert is_cached("acme/here") and is_cached("acme/here-GGUF/m.gguf")
    assert not is_cached("acme/elsewhere")
    assert not is_cached("acme/here-GGUF/other.gguf")
    assert not is_cached("and/or..") and not is_cached("no-slash") and not is_cached("a/b/c")
