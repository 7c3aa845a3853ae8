"""`serve` takes the model's sampling defaults (generation_config.json) for the fields a
request leaves out, as vLLM's --generation-config auto; `vllm` turns that off.

Oracle: mlx-lm's greedy continuation of the same weights (the model's config says
temperature 0 and 5 new tokens), decoded by the `tokenizers` library.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy
from tests.paths import ROOT
from tests.server_harness import start_server

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    oracle, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=7)
    (model_dir / "generation_config.json").write_text(
        '{"temperature": 0.0, "max_new_tokens": 5, "eos_token_id": 0}'
    )
    return oracle, model_dir


def _completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_without_sampling_fields_take_the_models_defaults(tiny, tmp_path) -> None:
    oracle, model_dir = tiny
    tokens, _ = mlx_lm_greedy(oracle, PROMPT, 5)
    want = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(tokens)
    args = [str(model_dir), "--max-model-len", "64", "--served-model-name", "tiny"]
    server = start_server(args, tmp_path / "auto.log")
    try:
        assert "default sampling from the model's generation config" in server.log()
        for seed in (1, 2):  # greedy whatever the seed: temperature 0 is the default
            out = _completion(server.url, seed=seed)
            assert out["usage"]["completion_tokens"] == 5  # max_new_tokens
            assert out["choices"][0]["text"] == want
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        # A field the request sets wins over the model's default.
        texts = {
            _completion(server.url, seed=s, temperature=1.0)["choices"][0]["text"]
            for s in (1, 2, 3)
        }
        assert len(texts) > 1
        assert _completion(server.url, max_tokens=3)["usage"]["completion_tokens"] == 3
        other_apis_take_the_defaults(server.url)
    finally:
        server.stop()


def test_generation_config_vllm_keeps_openais_defaults(tiny, tmp_path) -> None:
    _, model_dir = tiny
    args = [str(model_dir), "--max-model-len", "64", "--generation-config", "vllm"]
    server = start_server(args, tmp_path / "vllm.log")
    try:
        outs = [_completion(server.url, seed=s) for s in (1, 2, 3)]
        assert all(o["usage"]["completion_tokens"] == 16 for o in outs)  # OpenAI's max_tokens
        assert len({o["choices"][0]["text"] for o in outs}) > 1  # temperature 1
    finally:
        server.stop()


def test_a_bad_generation_config_is_an_error_before_loading(tmp_path) -> None:
    cmd = [sys.executable, "-m", "mlxserve.cli", "serve", "--generation-config", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0
    assert "--generation-config" in out.stderr and "generation_config.json" in out.stderr
    assert "loading" not in out.stderr


def other_apis_take_the_defaults(url: str) -> None:
    """Responses, Anthropic and Ollama requests without sampling fields: greedy (two calls
    agree) and, where the API has no required length, max_new_tokens long."""
    hi = [{"role": "user", "content": "hi"}]
    calls = {
        "/v1/responses": {"model": "tiny", "input": "hi"},
        "/v1/messages": {"model": "tiny", "max_tokens": 8, "messages": hi},
        "/api/generate": {"model": "tiny", "prompt": "hi", "raw": True, "stream": False},
    }
    for path, body in calls.items():
        outs = []
        for _ in range(2):
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, (path, r.text)
            outs.append(r.json())
        if path == "/v1/responses":
            assert outs[0]["usage"]["output_tokens"] == 5
            texts = [o["output"][0]["content"][0]["text"] for o in outs]
            assert texts[0] == texts[1]
        elif path == "/v1/messages":
            assert outs[0]["content"] == outs[1]["content"]
        else:
            assert outs[0]["eval_count"] == 5 and outs[0]["response"] == outs[1]["response"]


def test_the_embedded_model_serves_with_its_cards_defaults(tmp_path) -> None:
    """The default model has no generation_config: its model card's temperature 0.2 and
    top_p 0.9 are its defaults, so a request without them samples as one that sets them."""
    server = start_server(["--max-model-len", "256"], tmp_path / "embedded.log")
    try:
        assert "temperature=0.2, top_p=0.9" in server.log()
        question = [{"role": "user", "content": "What is the capital of France?"}]

        def answer(**fields) -> str:
            body = {"messages": question, "max_tokens": 12, "ignore_eos": True, **fields}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        for seed in (1, 2):
            assert answer(seed=seed) == answer(seed=seed, temperature=0.2, top_p=0.9)
    finally:
        server.stop()
