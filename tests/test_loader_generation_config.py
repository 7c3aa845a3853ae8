"""A model's sampling defaults: generation_config.json, or a GGUF's general.sampling.* keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from mlxserve.loader import load_model, resolve_model
from mlxserve.loader.generation_config import from_gguf_metadata, from_model_dir
from tests.engine_helpers import make_tiny_model_dir
from tests.gguf_helpers import write_gguf
from tests.model_helpers import make_mlx_lm_checkpoint, tiny_config


def write_generation_config(model_dir: Path, config: dict | str) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (model_dir / "generation_config.json").write_text(text)


def test_the_sampling_keys_of_generation_config_json(tmp_path: Path, caplog) -> None:
    # Qwen2.5-Instruct's values, plus keys that are not sampling defaults, plus bad ones.
    write_generation_config(
        tmp_path,
        {
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
            "repetition_penalty": 1.05,
            "max_new_tokens": 512,
            "eos_token_id": [151645, 151643],
            "min_p": "0.1",
        },
    )
    with caplog.at_level(logging.WARNING, logger="mlxserve"):
        got = from_model_dir(tmp_path)
    assert got == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 512,
    }
    assert "ignoring min_p='0.1' (not a number)" in caplog.text


def test_values_samplingparams_refuses_are_dropped(tmp_path: Path, caplog) -> None:
    write_generation_config(tmp_path, {"top_p": 0, "temperature": -1, "top_k": 40.0})
    with caplog.at_level(logging.WARNING, logger="mlxserve"):
        assert from_model_dir(tmp_path) == {"top_k": 40}
    assert "ignoring top_p (top_p must be > 0" in caplog.text  # SamplingParams' reason
    assert "ignoring temperature (temperature must be >= 0" in caplog.text


def test_no_or_unreadable_generation_config(tmp_path: Path, caplog) -> None:
    assert from_model_dir(tmp_path) == {}
    write_generation_config(tmp_path, "{not json")
    with caplog.at_level(logging.WARNING, logger="mlxserve"):
        assert from_model_dir(tmp_path) == {}
    assert "generation_config.json: unreadable" in caplog.text


def test_gguf_sampling_metadata() -> None:
    meta = {
        "general.sampling.temp": 0.699999988079071,  # 0.7 as float32
        "general.sampling.top_k": 20,
        "general.sampling.top_p": 0.800000011920929,
        "general.sampling.min_p": 0.0,
        "general.sampling.penalty_repeat": 1.0499999523162842,
        "general.sampling.penalty_last_n": 64,  # no equivalent: penalties see everything
        "general.name": "x",
    }
    assert from_gguf_metadata(meta) == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
    }


def test_load_model_carries_the_defaults(tmp_path: Path) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path / "dir")
    assert load_model(str(model_dir)).generation_defaults == {}
    write_generation_config(model_dir, {"temperature": 0.6, "top_p": 0.9})
    loaded = load_model(str(model_dir))
    assert loaded.generation_defaults == {"temperature": 0.6, "top_p": 0.9}

    config = tiny_config()
    oracle, _ = make_mlx_lm_checkpoint(tmp_path / "ckpt", config)
    weights = {k: np.array(v) for k, v in tree_flatten(oracle.parameters())}
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, config, weights, metadata={"general.sampling.temp": 0.25})
    loaded = load_model(str(gguf_path), skip_tokenizer_init=True)
    assert loaded.generation_defaults == {"temperature": 0.25}


def test_the_embedded_model_has_none(smollm2_gguf: Path) -> None:
    from mlxserve.gguf_file import read_gguf_metadata

    assert from_gguf_metadata(read_gguf_metadata(smollm2_gguf)) == {}


# HuggingFaceTB/SmolLM2-135M-Instruct's model card: generate(..., temperature=0.2, top_p=0.9)
CARD = {"temperature": 0.2, "top_p": 0.9}


def test_the_embedded_model_carries_its_cards_defaults(smollm2_gguf: Path, tmp_path) -> None:
    """Its GGUF has no general.sampling.*, so its resolution brings the card's values, by
    default or named by its path; a copy of the file elsewhere is just a GGUF."""
    loaded = load_model(None, skip_tokenizer_init=True)
    assert loaded.generation_defaults == CARD
    assert load_model(str(smollm2_gguf), skip_tokenizer_init=True).generation_defaults == CARD
    (tmp_path / "copy.gguf").symlink_to(smollm2_gguf)  # the same file: the same model
    assert resolve_model(str(tmp_path / "copy.gguf")).sampling_defaults == CARD


def test_llm_without_sampling_params_takes_the_models_defaults(tmp_path: Path) -> None:
    """As vLLM's LLM.generate: no SamplingParams means the model's defaults. Here greedy
    and 5 tokens (the oracle: the same request with those set explicitly)."""
    from mlxserve import LLM, SamplingParams

    _, model_dir = make_tiny_model_dir(tmp_path / "dir")
    write_generation_config(model_dir, {"temperature": 0.0, "max_new_tokens": 5})
    llm = LLM(str(model_dir), num_blocks=32)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompt = [5, 17, 42]
    (want,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert want.outputs[0].finish_reason == "length"  # no EOS in the way of the count
    for _ in range(2):  # greedy: the same every time, where temperature 1 would differ
        (got,) = llm.generate([prompt], use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
