"""`mlxserve convert`: the embedded GGUF as a directory mlx-lm and transformers read,
checked against llama.cpp (tokens, chat template, greedy steps)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.cli.convert import convert
from mlxserve.cli.main import main
from tests.paths import check_llamacpp_step


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("convert") / "smollm2-mlx"
    assert main(["convert", str(smollm2_gguf), str(out)]) == 0
    return out


def test_mlx_lm_runs_the_converted_weights_like_llama_cpp(converted, llamacpp_oracle) -> None:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    config = json.loads((converted / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    model, tokenizer = load(str(converted))
    case = next(c for c in llamacpp_oracle["greedy"] if c["prompt"] == "The capital of France is")
    assert tokenizer.encode(case["prompt"]) == case["prompt_ids"]
    assert tokenizer.eos_token_ids == {0, 2}
    cache = make_prompt_cache(model)
    feed = case["prompt_ids"]
    num_clear = 0
    for step in case["steps"][:6]:
        logits = np.array(model(mx.array(feed)[None], cache=cache)[0, -1].astype(mx.float32))
        num_clear += check_llamacpp_step(step, logits)
        feed = [step["id"]]  # teacher-forced on llama.cpp's tokens
    assert num_clear >= 4


def test_transformers_reads_the_tokenizer_like_llama_cpp(converted, llamacpp_oracle) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    for case in llamacpp_oracle["tokenize"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
    for case in llamacpp_oracle["chat_template"]:
        rendered = tok.apply_chat_template(
            case["messages"], tokenize=False, add_generation_prompt=True
        )
        assert rendered == case["prompt"]
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")


def test_convert_refuses_a_non_empty_output_directory(smollm2_gguf, tmp_path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert(str(smollm2_gguf), tmp_path)
