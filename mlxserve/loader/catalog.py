"""The models on this machine, described without loading them: what `mlxserve list`,
`show` and `rm` print and do.

A model is a Hugging Face cache entry (``owner/name`` for a model directory,
``owner/name/file.gguf`` for one GGUF file of a repo), a GGUF file in a models folder, or a
path. Everything is read from headers: config.json and the safetensors JSON header, or the
GGUF metadata and tensor directory; no weights are read.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxserve.gguf_file import read_gguf_header
from mlxserve.loader import generation_config, hub
from mlxserve.loader.local import read_json
from mlxserve.tokenizer.gguf_vocab import chat_templates
from mlxserve.tokenizer.hf_dir import chat_template_from_dir

logger = logging.getLogger("mlxserve")

_MAX_HEADER_BYTES = 100 << 20  # a safetensors JSON header; real ones are a few MB at most


@dataclass(frozen=True)
class LocalModel:
    """One model on disk, as `mlxserve list` shows it."""

    name: str  # what run / serve / show / rm take
    path: Path  # the snapshot directory or the .gguf file
    format: str  # "safetensors" | "gguf"
    quantization: str  # "4-bit", "Q4_K_M", "bfloat16", ...
    size: int  # bytes on disk
    architecture: str
    context_length: int | None


@dataclass(frozen=True)
class ModelDetails:
    """What `mlxserve show` prints beyond :class:`LocalModel`."""

    model: LocalModel
    parameters: int
    # tensor type ("Q4_K", "affine 4-bit, group 64", "BF16", ...) -> (tensors, parameters)
    tensor_types: dict[str, tuple[int, int]]
    chat_template: str | dict[str, str] | None
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    license: str | None = None


def list_models(models_dir: Path | None = None) -> list[LocalModel]:
    """Every model in the hub cache, then every GGUF file under ``models_dir``."""
    from huggingface_hub import constants

    found: list[LocalModel | None] = []
    for repo_dir in sorted(Path(constants.HF_HUB_CACHE).glob("models--*")):
        repo_id = repo_dir.name.removeprefix("models--").replace("--", "/")
        snapshot = _snapshot(repo_dir)
        if snapshot is not None:
            found += _snapshot_models(repo_id, snapshot)
    if models_dir is not None:
        files = sorted(p for p in models_dir.rglob("*.gguf") if p.is_file())
        found += [_readable(p, str(p)) for p in files]
    return [m for m in found if m is not None]


def models_in_dir(models_dir: Path) -> list[tuple[str, Path]]:
    """(name, path) of every model under ``models_dir``: each directory that holds a
    config.json (not those inside another model's) and each .gguf file outside them,
    named by its path under ``models_dir`` (a .gguf without its suffix)."""
    dirs = sorted(p.parent for p in models_dir.rglob("config.json") if p.is_file())
    model_dirs: list[Path] = []
    for d in dirs:
        if not any(d.is_relative_to(m) for m in model_dirs):
            model_dirs.append(d)
    files = sorted(p for p in models_dir.rglob("*.gguf") if p.is_file())
    files = [f for f in files if not any(f.is_relative_to(m) for m in model_dirs)]
    found = [(d.relative_to(models_dir).as_posix(), d) for d in model_dirs if d != models_dir]
    found += [(f.relative_to(models_dir).with_suffix("").as_posix(), f) for f in files]
    return sorted(found)


def _readable(path: Path, name: str, size: int | None = None) -> LocalModel | None:
    """:func:`describe`, or None with a warning for a file that cannot be read (a
    truncated copy, a foreign file), so one bad file does not hide the others."""
    try:
        return describe(path, name, size)
    except ValueError as e:
        logger.warning("skipping %s: %s", name, e)
        return None


def find_model(name: str, models_dir: Path | None = None) -> LocalModel:
    """A model by the name `mlxserve list` shows (``owner/name:file.gguf`` too), or a path."""
    path = Path(name).expanduser()
    if path.is_file() or path.is_dir():
        return describe(path, name)
    ref = hub.split_gguf_ref(name)
    wanted = f"{ref[0]}/{ref[1]}" if ref else name
    for model in list_models(models_dir):
        if model.name == wanted:
            return model
    raise ValueError(
        f"model {name!r} is not on this machine (`mlxserve list` shows what is"
        + (f"; `mlxserve pull {name}` downloads it)" if ref or hub.is_repo_id(name) else ")")
    )


def describe(path: Path, name: str, size: int | None = None) -> LocalModel:
    """A model directory or GGUF file as a :class:`LocalModel` (headers only)."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json: not a model directory")
        config = read_json(path / "config.json")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        quant = _quant_config(config)
        if quant:
            mode = quant.get("mode", "affine")
            quantization = f"{quant['bits']}-bit" + ("" if mode == "affine" else f" {mode}")
        else:
            quantization = str(config.get("torch_dtype") or config.get("dtype") or "?")
        context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
        if size is None:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        architecture = str(config.get("model_type") or text.get("model_type") or "?")
        return LocalModel(name, path, "safetensors", quantization, size, architecture, context)
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: a model file must be a .gguf")
    meta = read_gguf_header(path).metadata
    arch = str(meta.get("general.architecture", "?"))
    context = meta.get(f"{arch}.context_length")
    return LocalModel(
        name, path, "gguf", _gguf_quantization(path, meta), path.stat().st_size, arch, context
    )


def details(model: LocalModel) -> ModelDetails:
    """Parameters, quantization per tensor type, chat template, sampling defaults, license."""
    if model.format == "gguf":
        header = read_gguf_header(model.path)
        types: dict[str, list[int]] = {}
        for tensor in header.tensors:
            entry = types.setdefault(tensor.qtype.name, [0, 0])
            entry[0] += 1
            entry[1] += math.prod(tensor.shape)
        meta = header.metadata
        template = chat_templates(meta)
        defaults = generation_config.from_gguf_metadata(meta, str(model.path))
        license_ = meta.get("general.license")
    else:
        config = read_json(model.path / "config.json")
        types = _safetensors_types(model.path, _quant_config(config))
        tokenizer_config = model.path / "tokenizer_config.json"
        template = chat_template_from_dir(
            model.path, read_json(tokenizer_config) if tokenizer_config.is_file() else {}
        )
        defaults = generation_config.from_model_dir(model.path)
        license_ = _card_license(model.path / "README.md")
    tensor_types = {label: (n, p) for label, (n, p) in sorted(types.items())}
    parameters = sum(p for _, p in tensor_types.values())
    return ModelDetails(
        model, parameters, tensor_types, template, defaults, str(license_) if license_ else None
    )


def remove(name: str) -> int:
    """Delete a hub-cache model (``owner/name``: the whole repo; ``owner/name/file.gguf``:
    that file); the bytes freed."""
    ref = hub.split_gguf_ref(name)
    repo_id, filename = ref if ref else (name, None)
    repo_dir = hub.repo_cache_dir(repo_id) if hub.is_repo_id(repo_id) else None
    if repo_dir is None or not repo_dir.is_dir():
        if Path(name).expanduser().exists():
            raise ValueError(f"{name}: not in the Hugging Face cache; delete the file yourself")
        find_model(name)  # raises the "not on this machine" error
    assert repo_dir is not None
    if filename is None:
        freed = _disk_bytes(repo_dir)
        shutil.rmtree(repo_dir)
        return freed
    snapshots = [s for s in (repo_dir / "snapshots").glob("*") if s.is_dir()]
    links = [s / filename for s in snapshots if (s / filename).is_symlink()]
    if not links:
        find_model(name)  # raises the "not on this machine" error
    blobs = {link.resolve() for link in links}
    for link in links:
        link.unlink()
    still_used = {f.resolve() for s in snapshots for f in s.rglob("*") if f.is_symlink()}
    freed = 0
    for blob in blobs - still_used:
        if blob.is_file():
            freed += blob.stat().st_size
            blob.unlink()
    if not still_used:  # nothing left of the repo
        shutil.rmtree(repo_dir)
    return freed


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snapshot = repo_dir / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = [s for s in (repo_dir / "snapshots").glob("*") if s.is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime) if snapshots else None


def _snapshot_models(repo_id: str, snapshot: Path) -> list[LocalModel | None]:
    """The model directory (when config.json is there) and each GGUF file of a snapshot."""
    files = [f for f in sorted(snapshot.rglob("*")) if f.is_file()]
    found = []
    if (snapshot / "config.json").is_file():
        size = sum(f.stat().st_size for f in files if f.suffix != ".gguf")
        found.append(_readable(snapshot, repo_id, size))
    for f in files:
        if f.suffix == ".gguf":
            found.append(_readable(f, f"{repo_id}/{f.relative_to(snapshot).as_posix()}"))
    return found


def _quant_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-community's ``quantization`` (or ``quantization_config``) when it gives bits."""
    quant = config.get("quantization") or config.get("quantization_config")
    return quant if isinstance(quant, dict) and "bits" in quant else None


def _gguf_quantization(path: Path, meta: dict[str, Any]) -> str:
    """general.file_type's name (Q4_K_M, ...), else the most common tensor type."""
    import gguf

    file_type = meta.get("general.file_type")
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        tensors = read_gguf_header(path).tensors
        counts = Counter(t.qtype.name for t in tensors if len(t.shape) > 1)
        return counts.most_common(1)[0][0] if counts else "?"


def _safetensors_types(path: Path, quant: dict[str, Any] | None) -> dict[str, list[int]]:
    """Tensor type -> [tensors, parameters] over a directory's safetensors headers; a
    quantized weight (with its .scales) counts once, with its unpacked size."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors |= _safetensors_header(f)
    types: dict[str, list[int]] = {}
    for name, (dtype, shape) in tensors.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{base}.weight" in tensors:
            continue  # part of a quantized weight
        label, count = dtype, math.prod(shape)
        if leaf == "weight" and f"{base}.scales" in tensors:
            layer = quant.get(base) if quant else None
            layer = layer if isinstance(layer, dict) else quant or {}
            bits, group = layer.get("bits"), layer.get("group_size")
            mode = layer.get("mode", (quant or {}).get("mode", "affine"))
            label = f"{mode} {bits}-bit, group {group}" if bits else "quantized"
            count = count * 32 // bits if bits and dtype == "U32" else count
        entry = types.setdefault(label, [0, 0])
        entry[0] += 1
        entry[1] += count
    return types


def _safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors file's JSON header."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        if not 0 < length <= _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return {name: (t["dtype"], tuple(t["shape"])) for name, t in header.items()}


def _card_license(readme: Path) -> str | None:
    """``license:`` from a model card's YAML front matter."""
    if not readme.is_file():
        return None
    lines = readme.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, colon, value = line.partition(":")
        if colon and key.strip() == "license" and value.strip():
            return value.strip().strip("'\"")
    return None


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
