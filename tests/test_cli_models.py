"""`mlxserve pull / list / show / rm / ps` as a user sees them, against a fake hub.

The hub is tests/fake_hub.py on 127.0.0.1 (HF_ENDPOINT), the cache a tmp dir (HF_HOME);
each command runs as `python -m mlxserve.cli` would for a user. The models are tiny: an
mlx-community style 4-bit safetensors directory and GGUF files written with `gguf`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from tests.fake_hub import FakeHub, serve_fake_hub
from tests.gguf_helpers import write_gguf
from tests.model_helpers import tiny_config
from tests.paths import ROOT

MLX_REPO = "acme/tiny-4bit"
GGUF_REPO = "acme/tiny-GGUF"
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def mlx_model_files(tmp: Path) -> dict[str, bytes]:
    """An mlx-community style checkpoint: 4-bit layers, one 8-bit override, bf16 embeddings."""
    rng = np.random.default_rng(0)
    weights = {
        "model.embed_tokens.weight": mx.array(rng.normal(size=(320, 64))).astype(mx.bfloat16)
    }
    for name, bits in (("self_attn.q_proj", 4), ("self_attn.k_proj", 4), ("mlp.down_proj", 8)):
        w = mx.array(rng.normal(size=(64, 64)).astype(np.float32))
        packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
        prefix = f"model.layers.0.{name}"
        weights |= {f"{prefix}.weight": packed, f"{prefix}.scales": scales}
        weights[f"{prefix}.biases"] = biases
    path = tmp / "model.safetensors"
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    config = tiny_config(
        torch_dtype="bfloat16",
        quantization={
            "group_size": 64,
            "bits": 4,
            "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
        },
    )
    return {
        "config.json": json.dumps(config).encode(),
        "model.safetensors": path.read_bytes(),
        "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode(),
        "generation_config.json": json.dumps({"temperature": 0.6, "top_p": 0.95}).encode(),
        "README.md": b"---\nlicense: apache-2.0\ntags: [mlx]\n---\n# tiny\n",
        "pytorch_model.bin": b"not needed" * 100,  # never downloaded
    }


def gguf_file(tmp: Path, qtype: QT, file_type: LlamaFileType) -> bytes:
    rng = np.random.default_rng(1)
    config = tiny_config(max_position_embeddings=2048)
    weights = {
        "model.embed_tokens.weight": rng.normal(size=(320, 64)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(64, 64)).astype(np.float32),
        "model.layers.0.self_attn.k_proj.weight": rng.normal(size=(32, 64)).astype(np.float32),
        "model.norm.weight": np.ones(64, np.float32),
    }
    quantized = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")
    path = tmp / f"tiny-{qtype.name}.gguf"
    metadata = {
        "general.file_type": int(file_type),
        "general.license": "mit",
        "general.sampling.temp": 0.5,
        "tokenizer.chat_template": TEMPLATE,
    }
    write_gguf(path, config, weights, {n: qtype for n in quantized}, metadata=metadata)
    return path.read_bytes()


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    tmp = tmp_path_factory.mktemp("repos")
    return {
        MLX_REPO: mlx_model_files(tmp),
        GGUF_REPO: {
            "tiny.Q8_0.gguf": gguf_file(tmp, QT.Q8_0, LlamaFileType.MOSTLY_Q8_0),
            "tiny.Q4_0.gguf": gguf_file(tmp, QT.Q4_0, LlamaFileType.MOSTLY_Q4_0),
            "README.md": b"# tiny GGUF\n",
        },
    }


@pytest.fixture
def hub(repos) -> Iterator[FakeHub]:
    with serve_fake_hub(repos) as fake:
        yield fake


def mlxserve(
    home: Path, *args: str, endpoint: str = "http://127.0.0.1:9", **env: str
) -> subprocess.CompletedProcess:
    """`mlxserve ARGS` with a private Hugging Face home and hub."""
    return python(home, ["-m", "mlxserve.cli", *args], endpoint, **env)


def python(home: Path, argv: list[str], endpoint: str, **env: str) -> subprocess.CompletedProcess:
    """`python ARGV` with a private Hugging Face home and hub."""
    full_env = dict(os.environ, HF_HOME=str(home), HF_ENDPOINT=endpoint, HF_HUB_ETAG_TIMEOUT="5")
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        full_env.pop(name, None)
    full_env |= env
    full_env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, *argv],
        env=full_env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def table(stdout: str) -> dict[str, dict[str, str]]:
    """`mlxserve list` output -> {name: {column: value}}."""
    header, *rows = stdout.splitlines()
    columns = header.split()
    starts = [header.index(c) for c in columns]
    ends = [*starts[1:], None]
    cells = [
        {c: row[a:b].strip() for c, a, b in zip(columns, starts, ends, strict=True)} for row in rows
    ]
    return {row["NAME"]: row for row in cells}


def test_pull_downloads_the_model_files_with_progress(hub, tmp_path) -> None:
    out = mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url)
    assert out.returncode == 0, out.stderr
    size = len(hub.repos[MLX_REPO]["model.safetensors"])
    # a progress bar per file, with its size and the speed
    assert "model.safetensors: 100%" in out.stderr
    assert f"{size / 1000:.1f}k/{size / 1000:.1f}k" in out.stderr.replace("B", "")
    assert "/s]" in out.stderr
    assert out.stdout.startswith(f"pulled {MLX_REPO}: safetensors, 4-bit, ")
    assert out.stdout.rstrip().endswith("llama, context 512")
    fetched = {r.path.rsplit("/", 1)[1] for r in hub.requests if r.method == "GET"}
    assert "pytorch_model.bin" not in fetched  # only what a model directory needs
    assert "model.safetensors" in fetched and "README.md" in fetched
    # a second pull finds everything in the cache
    before = len(hub.gets_of("model.safetensors"))
    assert mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url).returncode == 0
    assert len(hub.gets_of("model.safetensors")) == before


def test_pull_one_gguf_file_by_quant_or_by_name(hub, tmp_path) -> None:
    out = mlxserve(tmp_path, "pull", GGUF_REPO, "--quant", "q8_0", endpoint=hub.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"pulled {GGUF_REPO}/tiny.Q8_0.gguf: gguf, Q8_0, ")
    assert hub.gets_of("tiny.Q4_0.gguf") == []
    out = mlxserve(tmp_path, "pull", f"{GGUF_REPO}:tiny.Q4_0.gguf", endpoint=hub.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"pulled {GGUF_REPO}/tiny.Q4_0.gguf: gguf, Q4_0, ")
    assert out.stdout.rstrip().endswith("llama, context 2048")
    out = mlxserve(tmp_path, "pull", f"hf.co/{GGUF_REPO}:Q4_0", endpoint=hub.url)  # Ollama's
    assert out.stdout.startswith(f"pulled {GGUF_REPO}/tiny.Q4_0.gguf: gguf, Q4_0, ")
    assert len(hub.gets_of("tiny.Q4_0.gguf")) == 1  # already there
    # several GGUF files and no choice: the choices, in one line
    out = mlxserve(tmp_path, "pull", GGUF_REPO, endpoint=hub.url)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"error: {GGUF_REPO} holds several GGUF files (tiny.Q4_0.gguf, tiny.Q8_0.gguf); pick "
        f"one with --quant (e.g. Q4_K_M) or as {GGUF_REPO}:FILE"
    ]
    out = mlxserve(tmp_path, "pull", GGUF_REPO, "--quant", "Q4_K_M", endpoint=hub.url)
    assert out.returncode == 2
    assert "none matches --quant Q4_K_M" in out.stderr


def test_an_interrupted_pull_resumes_where_it_stopped(hub, tmp_path) -> None:
    data = hub.repos[MLX_REPO]["model.safetensors"]
    hub.cut_after["model.safetensors"] = 3000
    out = mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url)
    assert out.returncode == 2
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(
        f"error: the download of model.safetensors stopped at 3000 of {len(data)}"
    )
    assert line.endswith("run the same command again to resume")
    out = mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url)
    assert out.returncode == 0, out.stderr
    first, second = hub.gets_of("model.safetensors")
    assert (first.range, first.num_bytes) == (None, 3000)
    assert (second.range, second.num_bytes) == ("bytes=3000-", len(data) - 3000)
    blob = tmp_path / "hub" / f"models--{MLX_REPO.replace('/', '--')}" / "blobs"
    assert (blob / hashlib.sha256(data).hexdigest()).read_bytes() == data


def test_ctrl_c_keeps_what_came_and_the_next_pull_resumes(hub, tmp_path) -> None:
    data = hub.repos[MLX_REPO]["model.safetensors"]
    hub.stall_after["model.safetensors"] = 5000
    blobs = tmp_path / "hub" / f"models--{MLX_REPO.replace('/', '--')}" / "blobs"
    partial = blobs / f"{hashlib.sha256(data).hexdigest()}.incomplete"
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_ENDPOINT=hub.url, PYTHONPATH=str(ROOT))
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxserve.cli", "pull", MLX_REPO],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size == 5000):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        hub.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert stderr.splitlines()[-1] == (
        f"error: the pull of {MLX_REPO} was interrupted; run the same command again to resume"
    )
    assert partial.stat().st_size == 5000
    out = mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url)
    assert out.returncode == 0, out.stderr
    assert hub.gets_of("model.safetensors")[-1].range == "bytes=5000-"
    assert (blobs / partial.stem).read_bytes() == data


def test_a_hub_that_ignores_range_restarts_the_file(hub, tmp_path) -> None:
    data = hub.repos[MLX_REPO]["model.safetensors"]
    hub.cut_after["model.safetensors"] = 3000
    assert mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url).returncode == 2
    hub.ignore_range = True
    out = mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url)
    assert out.returncode == 0, out.stderr
    last = hub.gets_of("model.safetensors")[-1]
    assert (last.range, last.num_bytes) == ("bytes=3000-", len(data))  # a 200: all of it
    blob = tmp_path / "hub" / f"models--{MLX_REPO.replace('/', '--')}" / "blobs"
    assert (blob / hashlib.sha256(data).hexdigest()).read_bytes() == data


def test_a_resumed_file_that_does_not_match_its_sha256_is_removed(hub, tmp_path) -> None:
    data = hub.repos[MLX_REPO]["model.safetensors"]
    blobs = tmp_path / "hub" / f"models--{MLX_REPO.replace('/', '--')}" / "blobs"
    blobs.mkdir(parents=True)
    partial = blobs / f"{hashlib.sha256(data).hexdigest()}.incomplete"
    partial.write_bytes(b"\xff" * 3000)  # a partial download gone bad
    out = mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "error: the download of model.safetensors does not match the hub's sha256 and was "
        "removed; run the same command again"
    )
    assert not partial.exists()
    assert mlxserve(tmp_path, "pull", MLX_REPO, endpoint=hub.url).returncode == 0
    assert (blobs / partial.stem).read_bytes() == data


def test_offline_or_no_hub_is_one_error_line(tmp_path) -> None:
    out = mlxserve(tmp_path, "pull", MLX_REPO, HF_HUB_OFFLINE="1")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [
        f"error: cannot pull '{MLX_REPO}': offline mode is on (HF_HUB_OFFLINE=1)"
    ]
    out = mlxserve(tmp_path, "pull", MLX_REPO)  # port 9: nothing listens
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith(
        f"error: cannot pull '{MLX_REPO}': the hub at http://127.0.0.1:9 cannot be reached ("
    )


def test_a_model_the_hub_does_not_have_is_one_error_line(hub, tmp_path) -> None:
    out = mlxserve(tmp_path, "pull", "acme/nothing", endpoint=hub.url)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: model 'acme/nothing' was not found on the Hugging Face hub (check the name, "
        "or log in if it is private); it is not a local path either"
    ]


def test_list_show_and_rm(hub, repos, tmp_path) -> None:
    home = tmp_path / "home"
    for args in ([MLX_REPO], [GGUF_REPO, "--quant", "Q8_0"]):
        assert mlxserve(home, "pull", *args, endpoint=hub.url).returncode == 0
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "local.gguf").write_bytes(repos[GGUF_REPO]["tiny.Q4_0.gguf"])

    out = mlxserve(home, "list", "--models-dir", str(folder))
    assert out.returncode == 0, out.stderr
    rows = table(out.stdout)
    mlx_size = sum(len(v) for k, v in repos[MLX_REPO].items() if k != "pytorch_model.bin")
    assert rows[MLX_REPO] == {
        "NAME": MLX_REPO,
        "FORMAT": "safetensors",
        "QUANT": "4-bit",
        "SIZE": f"{mlx_size / 1000:.1f} kB",
        "ARCH": "llama",
        "CONTEXT": "512",
    }
    gguf_row = rows[f"{GGUF_REPO}/tiny.Q8_0.gguf"]
    assert (gguf_row["FORMAT"], gguf_row["QUANT"], gguf_row["ARCH"]) == ("gguf", "Q8_0", "llama")
    assert gguf_row["CONTEXT"] == "2048"
    assert rows[str(folder / "local.gguf")]["QUANT"] == "Q4_0"
    (folder / "broken.gguf").write_bytes(b"GGUF" + bytes(8))  # a truncated copy
    out = mlxserve(home, "list", "--models-dir", str(folder))
    assert table(out.stdout) == rows  # the others still listed
    (warning,) = out.stderr.splitlines()
    assert warning.startswith(f"WARNING mlxserve: skipping {folder / 'broken.gguf'}: ")
    in_cache = {name: row for name, row in rows.items() if not name.startswith(str(folder))}
    assert table(mlxserve(home, "ls").stdout) == in_cache  # the alias; no folder: the cache

    out = mlxserve(home, "show", MLX_REPO)
    assert out.returncode == 0, out.stderr
    assert "  affine 4-bit, group 64  2 tensors, 8.19K parameters" in out.stdout
    assert "  affine 8-bit, group 64  1 tensor, 4.1K parameters" in out.stdout
    assert "  BF16                    1 tensor, 20.5K parameters" in out.stdout
    assert "  license         apache-2.0" in out.stdout
    assert "  temperature  0.6" in out.stdout
    assert out.stdout.rstrip().endswith(f"Chat template\n  {TEMPLATE}")
    out = mlxserve(home, "show", f"{GGUF_REPO}:tiny.Q8_0.gguf")
    assert out.returncode == 0, out.stderr
    assert "  Q8_0  2 tensors, 6.14K parameters" in out.stdout
    assert "  F32   2 tensors, 20.5K parameters" in out.stdout
    assert "  license         mit" in out.stdout
    assert mlxserve(home, "show", GGUF_REPO + "/tiny.Q8_0.gguf", "--template").stdout == (
        TEMPLATE + "\n"
    )

    out = mlxserve(home, "rm", MLX_REPO, f"{GGUF_REPO}/tiny.Q8_0.gguf")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"deleted {MLX_REPO} (")
    assert table(mlxserve(home, "list").stdout) == {}
    assert not (home / "hub" / f"models--{MLX_REPO.replace('/', '--')}").exists()


def test_a_missing_model_is_a_clear_error(tmp_path) -> None:
    for command in ("show", "rm"):
        out = mlxserve(tmp_path, command, "acme/absent")
        assert out.returncode == 2
        assert out.stderr.splitlines() == [
            "error: model 'acme/absent' is not on this machine (`mlxserve list` shows what "
            "is; `mlxserve pull acme/absent` downloads it)"
        ]


def test_run_and_serve_download_through_the_same_resumable_path(hub, tmp_path) -> None:
    """resolve_model (run, serve, LLM) fetches as pull does; a repo of one GGUF file is
    that file; offline, the cached copy is used."""
    hub.repos["acme/one-GGUF"] = {"m.Q8_0.gguf": hub.repos[GGUF_REPO]["tiny.Q8_0.gguf"]}
    code = (
        "from mlxserve.loader import resolve_model\n"
        "for name in ('acme/tiny-4bit', 'acme/one-GGUF'):\n"
        "    source = resolve_model(name)\n"
        "    print(source.kind, source.path.name)\n"
    )
    for offline in ("0", "1"):
        out = python(tmp_path, ["-c", code], hub.url, HF_HUB_OFFLINE=offline)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("dir ") and lines[1] == "gguf m.Q8_0.gguf"
    assert len(hub.gets_of("m.Q8_0.gguf")) == 1


def test_loading_shows_weights_read_of_total(monkeypatch) -> None:
    import io

    import mlx.nn as nn

    from mlxserve import loader
    from mlxserve.loader import read_weights_with_progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(loader, "_READ_STEP_BYTES", 100_000)
    net = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # 2 x 263 kB, float32
    read_weights_with_progress(net, "tiny")
    shown = terminal.getvalue()
    assert "Loading tiny:  50%" in shown and "/526k [" in shown  # one layer of two
    assert "Loading tiny: 100%" in shown and "526k/526k [" in shown


@pytest.fixture
def fake_server() -> Iterator[tuple[str, dict[str, object]]]:
    """A server answering /api/ps (or, when its "ps" is None, only /v1/models)."""
    state: dict[str, object] = {
        "ps": {
            "models": [
                {
                    "name": "acme/tiny-4bit",
                    "size": 1_500_000,
                    "size_vram": 0,
                    "context_length": 4096,
                    "expires_at": "2999-01-01T00:00:00Z",
                }
            ]
        }
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/api/ps" and state["ps"] is not None:
                body = state["ps"]
            elif self.path == "/v1/models":
                body = {"object": "list", "data": [{"id": "acme/tiny-4bit", "object": "model"}]}
            else:
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def test_ps_asks_the_running_server(fake_server, tmp_path) -> None:
    url, state = fake_server
    out = mlxserve(tmp_path, "ps", "--url", url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "NAME            MEMORY  CONTEXT  UNTIL",
        "acme/tiny-4bit  1.5 MB  4096     forever",
    ]
    soon = datetime.now(timezone.utc) + timedelta(minutes=5, seconds=20)
    state["ps"]["models"][0]["expires_at"] = soon.isoformat().replace("+00:00", "Z")
    out = mlxserve(tmp_path, "ps", "--url", url)
    assert out.stdout.splitlines()[1].endswith("  5 minutes from now")
    state["ps"] = None  # a server without Ollama's API: names only
    out = mlxserve(tmp_path, "ps", "--url", url)
    assert out.stdout.splitlines()[1].split() == ["acme/tiny-4bit", "?", "?", "?"]
    out = mlxserve(tmp_path, "ps", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: no mlxserve server answers at http://127.0.0.1:9 (")


def test_ps_against_mlxserve_serve(tmp_path) -> None:
    """The real server's /api/ps, with its API key: the served model, its memory, forever."""
    from tests.engine_helpers import make_tiny_model_dir
    from tests.server_harness import start_server

    _, model_dir = make_tiny_model_dir(tmp_path / "tiny", seed=3)
    args = [str(model_dir), "--served-model-name", "tiny", "--dtype", "float32"]
    server = start_server([*args, "--api-key", "k", "--max-model-len", "256"], tmp_path / "log")
    try:
        out = mlxserve(tmp_path, "ps", "--url", server.url, MLXSERVE_API_KEY="k")
        refused = mlxserve(tmp_path, "ps", "--url", server.url)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    name, memory, unit, context, until = out.stdout.splitlines()[1].split()
    assert (name, unit, context, until) == ("tiny", "kB", "256", "forever")
    assert float(memory) > 0
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"error: {server.url}/api/ps answered HTTP 401: pass the server's API key with "
        "--api-key (or $MLXSERVE_API_KEY)"
    ]
