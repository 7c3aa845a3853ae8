"""Loading errors: each a ValueError that starts with the offending file and says what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxserve.loader import load_model
from mlxserve.loader.local import read_model_dir
from mlxserve.models import get_model_class
from tests.gguf_helpers import close_gguf, write_gguf
from tests.model_helpers import save_checkpoint

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "tie_word_embeddings": True,
}


def weights_for(config: dict) -> dict[str, mx.array]:
    model_cls, args_cls = get_model_class(config["model_type"])
    return dict(tree_flatten(model_cls(args_cls.from_dict(config)).parameters()))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "m", CONFIG, weights_for(CONFIG))


def raises_for(path: Path, problem: str):
    """pytest.raises for a ValueError whose message is '<path>: <problem...>'."""
    return pytest.raises(ValueError, match="^" + re.escape(f"{path}: ") + problem)


def test_sanity_the_fixture_loads(model_dir: Path) -> None:
    assert load_model(str(model_dir), skip_tokenizer_init=True).config["vocab_size"] == 96


def test_missing_config_json(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with raises_for(model_dir, "no config.json"):
        read_model_dir(model_dir)
    with raises_for(model_dir, "no config.json and no .gguf file"):
        load_model(str(model_dir), skip_tokenizer_init=True)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"model_type": "llama",', r"invalid JSON \(Expecting"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"hidden_size": 64}', "no model_type"),
        (b"\xff\xfe{}", r"invalid JSON \("),
    ],
)
def test_bad_config_json(model_dir: Path, text: str | bytes, problem: str) -> None:
    path = model_dir / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with raises_for(path, problem):
        load_model(str(model_dir), skip_tokenizer_init=True)


def test_unknown_model_type(model_dir: Path) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**CONFIG, "model_type": "gpt5"}))
    with raises_for(path, r"unsupported model_type 'gpt5'; supported: .*\bllama, "):
        load_model(str(model_dir), skip_tokenizer_init=True)


def test_mlx_lm_architecture_not_run_says_why(model_dir: Path) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**CONFIG, "model_type": "llama4"}))
    with raises_for(path, r"unsupported model_type 'llama4' \(chunked local attention"):
        load_model(str(model_dir), skip_tokenizer_init=True)


def test_shard_index_names_a_missing_file(model_dir: Path) -> None:
    index = model_dir / "model.safetensors.index.json"
    weight_map = {"model.norm.weight": "model-00001-of-00002.safetensors"}
    weight_map["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    with raises_for(index, r"lists shard\(s\) that are missing: model-00002-of-00002"):
        load_model(str(model_dir), skip_tokenizer_init=True)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(model_dir: Path, damage: str) -> None:
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    corrupt = {
        "truncated": data[: len(data) // 2],
        "garbage": b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" * 4,
        "empty": b"",
    }[damage]
    path.write_bytes(corrupt)
    with raises_for(path, "corrupt or unreadable safetensors file"):
        load_model(str(model_dir), skip_tokenizer_init=True)


def test_wrong_weight_shape_names_parameter_and_shapes(model_dir: Path) -> None:
    weights = weights_for(CONFIG)
    weights["model.layers.0.self_attn.k_proj.weight"] = mx.zeros((64, 64))
    save_checkpoint(model_dir, CONFIG, weights)
    with raises_for(
        model_dir,
        r"cannot load llama weights: wrong shape for model\.layers\.0\.self_attn\.k_proj"
        r"\.weight: expected \(32, 64\), got \(64, 64\)$",
    ):
        load_model(str(model_dir), skip_tokenizer_init=True)


def test_missing_and_unexpected_weights(model_dir: Path) -> None:
    weights = weights_for(CONFIG)
    del weights["model.norm.weight"]
    weights["model.layers.0.mlp.extra.weight"] = mx.zeros((2,))
    save_checkpoint(model_dir, CONFIG, weights)
    with raises_for(
        model_dir,
        r"cannot load llama weights: missing weight model\.norm\.weight; "
        r"and 1 more problem \(1 unexpected\)$",
    ):
        load_model(str(model_dir), skip_tokenizer_init=True)


def test_a_config_that_disagrees_with_its_weights_is_one_line(model_dir: Path) -> None:
    """A wrong hidden_size makes nearly every tensor a mismatch: the first is named and the
    rest counted, in one line (it was one line per tensor, 695 for a real model)."""
    weights = weights_for({**CONFIG, "hidden_size": 32, "num_hidden_layers": 2})
    save_checkpoint(model_dir, CONFIG, weights)
    with pytest.raises(ValueError) as info:
        load_model(str(model_dir), skip_tokenizer_init=True)
    message = str(info.value)
    assert "\n" not in message
    # Oracle: the same comparison done here by hand over the two parameter trees.
    expected, got = weights_for(CONFIG), weights
    shapes = [n for n in sorted(set(expected) & set(got)) if expected[n].shape != got[n].shape]
    unexpected = sorted(set(got) - set(expected))
    assert not set(expected) - set(got)
    assert message == (
        f"{model_dir}: cannot load llama weights: unexpected weight {unexpected[0]}; and "
        f"{len(unexpected) + len(shapes) - 1} more problems ({len(unexpected) - 1} unexpected, "
        f"{len(shapes)} wrong shape)"
    )


def write_gguf_file(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 128)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    for name, (arr, raw_dtype) in tensors.items():
        writer.add_tensor(name, arr, raw_dtype=raw_dtype)
    close_gguf(writer)
    return path


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    embd = {"token_embd.weight": (np.zeros((8, 64), np.float32), None)}
    path = write_gguf_file(tmp_path / "g.gguf", "gpt2", embd)
    with raises_for(path, r"unsupported GGUF architecture 'gpt2' \(general\.architecture\)"):
        load_model(str(path), skip_tokenizer_init=True)
    # Also when the tensors need the gguf package (here a K-quant) rather than mx.load.
    q6k = gguf.GGMLQuantizationType.Q6_K
    raw = np.zeros((8, gguf.GGML_QUANT_SIZES[q6k][1]), np.uint8)
    path = write_gguf_file(tmp_path / "k.gguf", "gpt2", {"token_embd.weight": (raw, q6k)})
    with raises_for(path, "unsupported GGUF architecture 'gpt2'"):
        load_model(str(path), skip_tokenizer_init=True)


def test_unknown_gguf_tensor_type(tmp_path: Path) -> None:
    # Q8_K is a type llama.cpp uses only for intermediate products: no dequantizer exists.
    q8k = gguf.GGMLQuantizationType.Q8_K
    raw = np.zeros((64, gguf.GGML_QUANT_SIZES[q8k][1]), np.uint8)
    tensors = {
        "token_embd.weight": (np.zeros((8, 64), np.float32), None),
        "blk.0.attn_q.weight": (raw, q8k),
    }
    path = write_gguf_file(tmp_path / "odd.gguf", "llama", tensors)
    with raises_for(path, r"tensor blk\.0\.attn_q\.weight: unsupported GGUF tensor type Q8_K"):
        load_model(str(path), skip_tokenizer_init=True)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("text", r"not a GGUF file \(starts with b'not '"),
        ("empty", r"not a GGUF file \(it is empty\)"),
        ("bad version", r"GGUF version 1953849888 is not supported"),  # crashes mx.load
        ("huge counts", "corrupt or truncated GGUF file: header claims"),  # crashes mx.load
        ("cut in metadata", "corrupt or truncated GGUF file"),
        (
            "cut in tensor data",
            r"corrupt or truncated GGUF file: tensor token_embd\.weight ends at byte \d+, past",
        ),
    ],
)
def test_corrupt_gguf(tmp_path: Path, damage: str, problem: str) -> None:
    tensors = {"token_embd.weight": (np.zeros((64, 64), np.float32), None)}
    good = write_gguf_file(tmp_path / "good.gguf", "llama", tensors).read_bytes()
    corrupt = {
        "text": b"not a gguf at all",
        "empty": b"",
        "bad version": b"GGUF but not really" * 10,
        "huge counts": good[:8] + b"\xff" * 16 + good[24:],
        "cut in metadata": good[:60],
        "cut in tensor data": good[:-100],
    }[damage]
    path = tmp_path / "bad.gguf"
    path.write_bytes(corrupt)
    with raises_for(path, problem):
        load_model(str(path), skip_tokenizer_init=True)


def test_missing_tokenizer(model_dir: Path) -> None:
    with raises_for(model_dir / "tokenizer.json", "not found"):
        load_model(str(model_dir))


def test_bad_dtype(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported; choose one of auto,"):
        load_model(str(model_dir), dtype="int8", skip_tokenizer_init=True)


def test_random_header_corruption_is_a_value_error_or_loads(tmp_path: Path) -> None:
    """Flipped header bytes never crash the process (MLX's own GGUF reader can segfault on
    them): the file loads or a ValueError names it."""
    weights = {k: np.array(v) for k, v in weights_for(CONFIG).items()}
    config = {**CONFIG, "max_position_embeddings": 64, "rope_theta": 1e4, "rms_norm_eps": 1e-5}
    good_path = tmp_path / "good.gguf"
    write_gguf(good_path, config, weights)
    good = good_path.read_bytes()
    header_size = len(good) - sum(w.nbytes for w in weights.values())
    rng = np.random.default_rng(0)
    path = tmp_path / "flipped.gguf"
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(150):
        data = bytearray(good)
        for pos in rng.integers(0, header_size, rng.integers(1, 4)):
            data[pos] = rng.integers(0, 256)
        path.write_bytes(bytes(data))
        try:
            load_model(str(path), skip_tokenizer_init=True)
            outcomes["loaded"] += 1
        except ValueError as e:
            assert str(e).startswith(f"{path}: "), str(e)
            outcomes["refused"] += 1
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0, outcomes
