"""POST /v1/embeddings with the official openai SDK against `mlxserve serve` (tiny model).

Oracles: the `tokenizers` library for the token ids and mlx-lm's implementation of the
same weights for the final hidden states (last-token pooling, normalized with numpy).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import openai
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import metric, read_metrics, start_server, wait_until

TEXTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?", "Hi"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = tiny
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(model_dir), "--served-model-name", "tiny", "--dtype", "float32"]
    s = start_server(args + ["--max-model-len", "128", "--max-num-batched-tokens", "16"], log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def oracle_vector(tiny, text: str) -> np.ndarray:
    oracle, model_dir = tiny
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    h = np.array(oracle.model(mx.array(ids)[None])[0, -1].astype(mx.float32), dtype=np.float64)
    return h / np.linalg.norm(h)


def test_vectors_match_mlx_lm_unit_norm_and_batch_equals_one_by_one(client, tiny) -> None:
    out = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64
    assert out.model == "tiny" and [d.index for d in out.data] == [0, 1, 2]
    batch = np.array([d.embedding for d in out.data])
    assert batch.shape == (3, tiny[0].args.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(batch, [oracle_vector(tiny, t) for t in TEXTS], atol=1e-4)
    one_by_one = [client.embeddings.create(model="tiny", input=t).data[0].embedding for t in TEXTS]
    np.testing.assert_allclose(batch, one_by_one, atol=1e-5)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(batch, [d.embedding for d in floats.data], atol=1e-7)
    same = client.embeddings.create(model="tiny", input=[TEXTS[0], TEXTS[0]]).data
    np.testing.assert_allclose(same[0].embedding, same[1].embedding, atol=1e-5)
    hf = Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))
    num_tokens = sum(len(hf.encode(t).ids) for t in TEXTS)
    assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens


def test_token_id_inputs(client, tiny) -> None:
    ids = Tokenizer.from_file(str(tiny[1] / "tokenizer.json")).encode(TEXTS[1]).ids
    by_ids = client.embeddings.create(model="tiny", input=ids).data[0].embedding
    np.testing.assert_allclose(by_ids, oracle_vector(tiny, TEXTS[1]), atol=1e-4)
    two = client.embeddings.create(model="tiny", input=[ids, ids[:3]]).data
    np.testing.assert_allclose(two[0].embedding, by_ids, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"input": "hi", "dimensions": 8}, "dimensions", "not trained for shorter embeddings"),
        ({"input": []}, "input", "input"),
        ({"input": [""]}, "input", "empty"),
        ({"input": [[1, 2], [999999]]}, "input", "vocabulary"),
        ({"input": "x " * 200}, "input", "max_model_len is 128"),
        ({"input": "hi", "model": "nope"}, "model", "does not exist"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(client, kwargs, param, message) -> None:
    kwargs = {"model": "tiny"} | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(encoding_format="float", **kwargs)
    assert e.value.status_code == (404 if param == "model" else 400)
    assert e.value.body["param"] == param and message in e.value.body["message"]


def test_kv_blocks_are_free_afterwards_and_prompt_tokens_counted(client, server) -> None:
    def prompt_tokens() -> float:
        return metric(read_metrics(server.url), "vllm:prompt_tokens_total", model_name="tiny")

    before = prompt_tokens()
    out = client.embeddings.create(model="tiny", input=TEXTS * 4)
    assert wait_until(lambda: prompt_tokens() == before + out.usage.prompt_tokens)
    values = read_metrics(server.url)
    assert metric(values, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
    assert metric(values, "vllm:num_requests_running", model_name="tiny") == 0


# ---- Ollama's /api/embed: the same limits and the same care --------------------------------
def test_ollama_embed_takes_as_many_inputs_as_v1_embeddings(server, tiny) -> None:
    import httpx

    from mlxserve.server.embeddings import MAX_EMBEDDING_INPUTS

    url = server.url + "/api/embed"
    r = httpx.post(url, json={"model": "tiny", "input": ["hi"] * (MAX_EMBEDDING_INPUTS + 1)})
    assert r.status_code == 400 and set(r.json()) == {"error"}  # Ollama's shape
    assert f"at most {MAX_EMBEDDING_INPUTS}" in r.json()["error"]
    r = httpx.post(url, json={"model": "tiny", "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    hf = Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))
    assert r.json()["prompt_eval_count"] == sum(len(hf.encode(t).ids) for t in TEXTS)
    assert len(r.json()["embeddings"]) == len(TEXTS)


def test_a_client_leaving_api_embed_is_not_an_internal_error(server) -> None:
    import json
    import socket
    from urllib.parse import urlsplit

    def running() -> float:
        return metric(read_metrics(server.url), "vllm:num_requests_running", model_name="tiny")

    # ~100 distinct tokens each (equal texts would share their prefix-cached blocks) at 16
    # batched tokens a step: thousands of steps, so the request is still running when the
    # client hangs up however fast the machine is (a fixed read timeout was not).
    texts = [f"{i} " + "The quick brown fox " * 24 for i in range(2048)]
    body = json.dumps({"model": "tiny", "input": texts}).encode()
    url = urlsplit(server.url)
    head = (
        f"POST /api/embed HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + body)
        assert wait_until(lambda: running() > 0, timeout=30)
    assert wait_until(lambda: running() == 0, timeout=60)  # aborted, not run to the end
    assert "internal error" not in server.log()
