"""Ollama's API with the official `ollama` client against `mlxserve serve --port <p>` (tiny model).

Oracles: mlx-lm's greedy tokens and final hidden states for the same weights, on prompts
rendered by hand (ChatML) and tokenized by the `tokenizers` library.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import ollama
import pytest
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy
from tests.server_harness import metric, read_metrics, start_server

KEY = "sk-ollama-test-key"
OPTIONS = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=7)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(tiny[1]), "--served-model-name", "tiny", "--dtype", "float32", "--api-key", KEY]
    s = start_server(args, log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


def greedy_text(tiny, prompt: str, n: int) -> tuple[str, int]:
    """mlx-lm's greedy continuation of ``prompt`` (text), and the prompt's token count."""
    oracle, model_dir = tiny
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    tokens, _ = mlx_lm_greedy(oracle, ids, n)
    return tok.decode(tokens), len(ids)


def chatml(*turns: tuple[str, str]) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n"


def test_list_show_ps_version(client, server) -> None:
    assert [m.model for m in client.list().models] == ["tiny"]
    shown = client.show("tiny:latest")
    assert shown.details.family == "llama" and shown.modelinfo["general.context_length"] > 0
    assert [m.model for m in client.ps().models] == ["tiny"]
    with pytest.raises(ollama.ResponseError) as e:
        client.show("other")
    assert e.value.status_code == 404 and "does not exist" in e.value.error


def test_chat_streamed_or_not_matches_mlx_lm(client, tiny) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want, num_prompt = greedy_text(tiny, chatml(("system", "Be brief."), ("user", "Hi!")), 6)
    out = client.chat("tiny", messages=messages, options=OPTIONS, stream=False)
    assert out.message.role == "assistant" and out.message.content == want
    assert (out.done, out.done_reason, out.eval_count) == (True, "length", 6)
    assert out.prompt_eval_count == num_prompt
    parts = list(client.chat("tiny", messages=messages, options=OPTIONS, stream=True))
    assert "".join(p.message.content for p in parts) == want
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]


def test_generate_applies_the_template_unless_raw(client, tiny) -> None:
    want, _ = greedy_text(tiny, chatml(("user", "The quick")), 6)
    assert client.generate("tiny", "The quick", options=OPTIONS).response == want
    want_raw, _ = greedy_text(tiny, "The quick", 6)
    parts = list(client.generate("tiny", "The quick", raw=True, options=OPTIONS, stream=True))
    assert "".join(p.response for p in parts) == want_raw and parts[-1].done


def test_embed_matches_mlx_lm_hidden_states(client, tiny) -> None:
    oracle, model_dir = tiny
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = ["a cat", "The quick brown fox"]
    out = client.embed("tiny", texts)
    for text, vec in zip(texts, out.embeddings, strict=True):
        ids = tok.encode(text).ids
        h = np.array(oracle.model(mx.array(ids)[None])[0, -1].astype(mx.float32), np.float64)
        np.testing.assert_allclose(vec, h / np.linalg.norm(h), atol=1e-4)
    assert out.prompt_eval_count == sum(len(tok.encode(t).ids) for t in texts)


def test_errors_in_ollamas_shape_and_the_key_is_required(client, server) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("tiny", messages=[{"role": "user", "content": "x"}], options={"mirostat": 2})
    assert e.value.status_code == 400 and "'mirostat' is not supported" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate("tiny", "x", options={"temperature": -1})
    assert e.value.status_code == 400 and "temperature must be >= 0" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url).list()
    assert e.value.status_code == 401 and e.value.error.startswith("invalid or missing API key")
    assert ollama.Client(host=server.url)._request_raw("GET", "/api/version").status_code == 200
    # Runtime options are the server's business: accepted, no effect.
    out = client.generate("tiny", "x", options=OPTIONS | {"num_ctx": 4096, "num_gpu": 1})
    assert out.done
    values = read_metrics(server.url)
    assert metric(values, "vllm:kv_cache_usage_perc", model_name="tiny") == 0


# ---- model management on a one-model server ---------------------------------------------------
def test_pull_and_delete_answer_in_ollamas_shape(client) -> None:
    assert client.pull("tiny").status == "success"  # it is here already
    assert [p.status for p in client.pull("tiny:latest", stream=True)][-1] == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 404 and "mlxserve serve llama3.2" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("tiny")
    assert e.value.status_code == 400 and "'tiny'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("llama3.2")
    assert e.value.status_code == 404 and "not found" in e.value.error


def test_keep_alive_zero_forgets_the_prefix_cache(client, server) -> None:
    from tests.server_harness import wait_until

    def counts() -> tuple[float, float]:
        """(prefix cache hits, prompt tokens computed), in tokens."""
        values = read_metrics(server.url)
        hits = metric(values, "vllm:prefix_cache_hits_total", model_name="tiny")
        return hits, metric(values, "vllm:prompt_tokens_total", model_name="tiny")

    def hits_of(**kwargs) -> float:
        """The prefix cache hits of one generation (once the metrics counted its prompt)."""
        hits, prompts = counts()
        client.generate("tiny", prompt, options=OPTIONS, **kwargs)
        assert wait_until(lambda: counts()[1] > prompts)
        return counts()[0] - hits

    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # several full blocks
    hits_of()
    assert hits_of() > 0  # the prefix was cached
    hits_of(keep_alive=0)
    assert wait_until(lambda: "keep_alive 0: forgot" in server.log())
    assert hits_of() == 0  # nothing left to hit
    # Ollama's "unload" request: answered as Ollama does; the model itself stays loaded.
    assert client.generate("tiny", "", keep_alive="0s").done_reason == "unload"
    assert client.generate("tiny", "").done_reason == "load"
    # The same through /api/chat: no messages (as Ollama's own CLI loads a model).
    unloaded = client.chat("tiny", [], keep_alive=0)
    assert (unloaded.done_reason, unloaded.message.content) == ("unload", "")
    assert client.chat("tiny", []).done_reason == "load"
    assert client.generate("tiny", "x", options=OPTIONS).done
