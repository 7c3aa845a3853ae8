"""Read a Hugging Face style model directory: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlxserve.models import supported_model_types, unsupported_message

INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    """A JSON object from a file, or a ValueError that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory: from the shard index when present, else *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index}: lists shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files")
    return files


def read_weights(files: list[Path]) -> dict[str, mx.array]:
    """All tensors of the given safetensors files (a duplicate name is an error)."""
    weights: dict[str, mx.array] = {}
    for path in files:
        try:
            shard = mx.load(str(path))
        except Exception as e:  # noqa: BLE001 -- MLX raises RuntimeError/ValueError variously
            raise ValueError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
        if not isinstance(shard, dict):
            raise ValueError(f"{path}: not a safetensors file")
        dup = sorted(set(shard) & set(weights))
        if dup:
            raise ValueError(f"{path}: tensor(s) already loaded from another shard: {dup[:5]}")
        weights.update(shard)
    return weights


def read_model_dir(model_dir: Path) -> tuple[dict, dict[str, mx.array]]:
    """(config, weights) of a model directory."""
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise ValueError(f"{model_dir}: no config.json (is this a model directory?)")
    config = read_json(config_path)
    if "model_type" not in config:
        raise ValueError(f"{config_path}: no model_type")
    if config["model_type"] not in supported_model_types():  # before reading the weights
        raise ValueError(f"{config_path}: {unsupported_message(config['model_type'])}")
    # mlx-community checkpoints say "quantization"; some tools say "quantization_config".
    qconf = config.get("quantization") or config.get("quantization_config")
    if qconf is not None and "bits" in qconf:
        config["quantization"] = qconf
    return config, read_weights(safetensors_files(model_dir))
