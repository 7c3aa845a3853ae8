"""All five APIs at once on one server: 16 concurrent clients, then disconnects on each API.

Every response is parsed by its API's official client (openai, anthropic, ollama), which
checks its shape; afterwards nothing runs and the KV cache is empty. A client that goes
away (streaming, or not) has its request aborted: the abort counter moves, the KV frees.
"""

from __future__ import annotations

import threading

import anthropic
import httpx
import ollama
import pytest
from openai import OpenAI

from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import metric, read_metrics, start_server, wait_until

NUM_CLIENTS = 16
LONG = 3000  # tokens: far more than a disconnect test waits for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=17)
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(model_dir), "--served-model-name", "tiny", "--max-model-len", "4096"]
    s = start_server(args + ["--disable-log-stats"], log)
    yield s
    s.stop()


def one_client(url: str, index: int) -> None:
    """A few calls on each API, streamed and not, checked by the official clients."""
    oa = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    ol = ollama.Client(host=url)
    msgs = [{"role": "user", "content": f"Client {index} says hi"}]
    chat = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    emb = oa.embeddings.create(model="tiny", input=[f"text {index}", "shared"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64
    resp = oa.responses.create(model="tiny", input=f"Hello {index}", max_output_tokens=4)
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens >= 1
    kinds = [
        e.type
        for e in oa.responses.create(model="tiny", input="x", max_output_tokens=3, stream=True)
    ]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    msg = an.messages.create(model="tiny", max_tokens=4, messages=msgs)
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with an.messages.stream(model="tiny", max_tokens=4, messages=msgs) as s:
        assert s.get_final_message().usage.output_tokens >= 1
    parts = list(ol.chat("tiny", messages=msgs, options={"num_predict": 4}, stream=True))
    assert parts[-1].done
    assert ol.generate("tiny", f"Once {index}", options={"num_predict": 4}).done
    assert len(ol.embed("tiny", "hi").embeddings[0]) == 64


def test_sixteen_clients_mixing_every_api(server) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            one_client(server.url, i)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert wait_until(lambda: idle(server.url))


def idle(url: str) -> bool:
    values = read_metrics(url)
    return (
        metric(values, "vllm:num_requests_running", model_name="tiny") == 0
        and metric(values, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
    )


def aborts(url: str) -> float:
    values = read_metrics(url)
    return metric(values, "vllm:request_success_total", model_name="tiny", finished_reason="abort")


# Greedy, so whether the answer would end by itself is deterministic (it does not, here).
MESSAGES = [{"role": "user", "content": "x"}]
STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": LONG, "temperature": 0}),
    "responses": ("/v1/responses", {"input": "x", "max_output_tokens": LONG, "temperature": 0}),
    "anthropic": ("/v1/messages", {"messages": MESSAGES, "max_tokens": LONG, "temperature": 0}),
    "ollama": (
        "/api/chat",
        {"messages": MESSAGES, "options": {"num_predict": LONG, "temperature": 0}},
    ),
}


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_disconnect_aborts_the_request(server, api: str) -> None:
    path, body = STREAMS[api]
    before = aborts(server.url)
    body = body | {"model": "tiny", "stream": True}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # it has started; now the client goes away
    assert wait_until(lambda: aborts(server.url) == before + 1 and idle(server.url))


def test_a_disconnect_while_waiting_for_a_whole_answer_aborts_it(server) -> None:
    before = aborts(server.url)
    options = {"num_predict": LONG, "temperature": 0}
    body = {"model": "tiny", "prompt": "x", "raw": True, "stream": False, "options": options}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/api/generate", json=body, timeout=1.0)
    assert wait_until(lambda: aborts(server.url) == before + 1 and idle(server.url))


def test_a_disconnect_aborts_embeddings_too(server) -> None:
    """2048 long inputs take many steps; the client leaves after a second: all are aborted."""
    before = aborts(server.url)
    body = {"model": "tiny", "input": ["The quick brown fox " * 15] * 2048}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/embeddings", json=body, timeout=1.0)
    assert wait_until(lambda: aborts(server.url) > before and idle(server.url))
