"""Internal failures: a 500 in OpenAI's shape (or an error event mid-stream), then the
server keeps serving. The app runs in-process under a real uvicorn so a fault can be
injected into the engine's model runner."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import anthropic
import httpx
import pytest
import uvicorn

from mlxserve.config import EngineConfig
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.exceptions import ParameterError
from mlxserve.server import ServerConfig, ServerMetrics, build_app
from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import (
    assert_openai_error,
    free_port,
    metric,
    read_metrics,
    stream_events,
    wait_until,
)


class Faults:
    """Makes the runner's launch() (start a step) or collect() (wait for it) raise."""

    def __init__(self, engine: LLMEngine) -> None:
        self.real = {"launch": engine.runner.launch, "collect": engine.runner.collect}
        self.fail_at: set[int] = set()
        self.where = "launch"
        self.calls = {"launch": 0, "collect": 0}
        engine.runner.launch = lambda *args, **kw: self._call("launch", *args, **kw)
        engine.runner.collect = lambda *args, **kw: self._call("collect", *args, **kw)

    def _call(self, name: str, *args, **kw):
        self.calls[name] += 1
        if name == self.where and self.calls[name] in self.fail_at:
            raise RuntimeError("injected fault")
        return self.real[name](*args, **kw)

    def fail_in(self, *steps: int, where: str = "launch") -> None:
        self.where = where
        self.fail_at = {self.calls[where] + s for s in steps}


@pytest.fixture(scope="module")
def app_server(tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=2)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=256))
    faults = Faults(engine)
    metrics = ServerMetrics("tiny")
    llm = AsyncLLM(engine, on_step=metrics.on_step)
    app = build_app(llm, metrics, ServerConfig(model_names=("tiny",), log_stats_interval=None))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=30)
    yield f"http://127.0.0.1:{port}", faults, engine
    server.should_exit = True
    thread.join(timeout=30)
    llm.shutdown()


BODY = {"prompt": [4, 5, 6], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def ok(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_failed_step_is_500_then_the_server_keeps_serving(app_server, where) -> None:
    url, faults, engine = app_server
    ok(url)
    faults.fail_in(2, where=where)  # the second step of the next request
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
    err = assert_openai_error(r, 500)
    assert err["type"] == "internal_error" and "injected fault" in err["message"]
    ok(url)
    # The failed request released its blocks.
    values = read_metrics(url)
    assert metric(values, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
    assert engine.get_num_unfinished_requests() == 0


def test_failure_mid_stream_is_an_error_event_then_done(app_server) -> None:
    url, faults, _ = app_server
    faults.fail_in(3)
    with httpx.Client(base_url=url, timeout=30) as http:
        # Status 200: the first token came before the fault; [DONE] still ends the stream.
        events = stream_events(http, "/v1/completions", BODY)
    error = events[-1]["error"]
    assert error["type"] == "internal_error" and "injected fault" in error["message"]
    assert all("choices" in e for e in events[:-1])
    ok(url)


def test_responses_failure_mid_stream_is_error_then_response_failed(app_server) -> None:
    from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

    url, faults, _ = app_server
    faults.fail_in(3)
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 6, "temperature": 0}
    events = []
    with httpx.stream("POST", url + "/v1/responses", json=body | {"stream": True}) as r:
        assert r.status_code == 200  # the first token came before the fault
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error = ResponseErrorEvent.model_validate(events[-2])
    failed = ResponseFailedEvent.model_validate(events[-1])
    assert "injected fault" in error.message and error.code == "internal_error"
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    ok(url)


def test_a_failing_handler_is_500_then_the_server_keeps_serving(app_server, monkeypatch) -> None:
    url, _, engine = app_server

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    r = httpx.post(url + "/v1/completions", json={"prompt": "text prompt"}, timeout=30)
    assert r.status_code == 500
    assert "tokenizer exploded" in r.json()["error"]["message"]
    monkeypatch.undo()
    ok(url)
    assert engine.get_num_unfinished_requests() == 0


def test_a_step_failure_fails_only_the_request_that_caused_it(app_server, monkeypatch) -> None:
    """Concurrent streams finish with their own tokens while the request that breaks the
    step (here: reading back its sampled token raises) gets a 500 naming it as the cause."""
    import asyncio

    from mlxserve.worker import model_runner

    url, _, engine = app_server
    victims = [BODY | {"prompt": [4 + i, 5, 6, 7 + 2 * i], "max_tokens": 12} for i in range(5)]
    attacker = BODY | {"prompt": [9, 9, 9], "max_tokens": 7}  # 7: the mark of the attacker

    async def text(http: httpx.AsyncClient, body: dict) -> str:
        chunks = []
        async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: ") :])
                    assert "error" not in event, event
                    chunks.append(event["choices"][0]["text"])
        return "".join(chunks)

    async def run(with_attacker: bool):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            jobs = [text(http, v) for v in victims]
            if with_attacker:
                jobs.append(http.post("/v1/completions", json=attacker))
            return await asyncio.gather(*jobs)

    reference = asyncio.run(run(False))
    real = model_runner.read_part

    def read(part):
        if any(r.sampling_params.max_tokens == 7 for r in part.samplers):
            raise RuntimeError("injected fault")
        return real(part)

    monkeypatch.setattr(model_runner, "read_part", read)
    *texts, failed = asyncio.run(run(True))
    assert texts == reference
    err = assert_openai_error(failed, 500)
    assert err["type"] == "internal_error"
    assert (
        "internal error while running this request: RuntimeError: injected fault"
        in (err["message"])
    )
    monkeypatch.undo()
    ok(url)
    assert metric(read_metrics(url), "vllm:kv_cache_usage_perc", model_name="tiny") == 0
    assert engine.get_num_unfinished_requests() == 0


def test_after_a_500_the_connection_is_closed_and_the_next_one_served(app_server, monkeypatch):
    """Issue 11: a keep-alive request after a 500 on the same connection was reset."""
    url, _, engine = app_server
    monkeypatch.setattr(engine.tokenizer, "encode", _broken)
    port = int(url.rsplit(":", 1)[1])
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 15\r\n\r\n{"prompt": "a"}'
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        head, body = _read_response(s)
        assert head.startswith(b"HTTP/1.1 500")
        assert b"\r\nconnection: close" in head.lower()
        assert b"tokenizer exploded" in body
        assert s.recv(1) == b""  # closed by the server, in order: no reset, no half-open socket
    monkeypatch.undo()
    # A pooled client (one connection) goes on without a transport error.
    with httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        monkeypatch.setattr(engine.tokenizer, "encode", _broken)
        r = http.post("/v1/completions", json={"prompt": "text"})
        assert r.status_code == 500 and r.headers["connection"] == "close"
        monkeypatch.undo()
        for _ in range(3):
            assert http.post("/v1/completions", json=BODY).status_code == 200


def _broken(*args, **kwargs):
    raise RuntimeError("tokenizer exploded")


def _read_response(s: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
    while len(body) < length:
        body += s.recv(65536)
    return head, body


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENGINE_ERRORS = [
    # (what the engine raises, the request, the param the client sees, text in the message)
    (ParameterError("max_tokens 99 is too many", "max_tokens"), BODY, "max_tokens", "max_tokens"),
    (
        ParameterError("max_tokens 99 is too many", "max_tokens"),
        CHAT | {"max_completion_tokens": 2},
        "max_completion_tokens",
        "max_completion_tokens 99 is too many",
    ),
    (ParameterError("max_tokens 99", "max_tokens"), CHAT, "max_tokens", "max_tokens 99"),
    (ParameterError("prompt is too long", "prompt"), BODY, "prompt", "prompt is too long"),
    (ParameterError("prompt is too long", "prompt"), CHAT, "messages", "prompt is too long"),
    (ValueError("prompt must not be empty"), BODY, None, "prompt must not be empty"),
    (ValueError("something else"), CHAT, None, "something else"),
]


@pytest.mark.parametrize("error,body,param,text", ENGINE_ERRORS)
def test_engine_rejections_name_the_request_field(
    app_server, monkeypatch, error, body, param, text
):
    url, _, engine = app_server

    def reject(*args, **kwargs):
        raise error

    monkeypatch.setattr(engine, "add_request", reject)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True):
        r = httpx.post(url + path, json=body | {"stream": stream}, timeout=30)
        err = assert_openai_error(r, 400)
        assert (err["param"], err["type"]) == (param, "invalid_request_error")
        assert text in err["message"]
    monkeypatch.undo()
    ok(url)


def test_a_slow_first_token_keeps_the_streams_alive(app_server, monkeypatch) -> None:
    """While a long prefill holds the first token back, a Responses stream repeats
    response.in_progress (Codex's idle timer counts events, not comments) and every other
    stream gets comment lines; both still parse as their APIs."""
    from openai.types.responses import ResponseInProgressEvent

    from mlxserve.server import streams

    url, faults, _ = app_server
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.05)
    real = faults.real["launch"]

    def slow(*args, **kw):  # every step a prefill of minutes, scaled down
        time.sleep(0.4)
        return real(*args, **kw)

    monkeypatch.setitem(faults.real, "launch", slow)
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "temperature": 0}
    events = []
    with httpx.stream("POST", url + "/v1/responses", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    first_output = kinds.index("response.output_item.added")
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:first_output].count("response.in_progress") >= 3  # ticks while waiting
    for e in events[1:first_output]:
        ResponseInProgressEvent.model_validate(e)
    assert kinds[-1] == "response.incomplete"  # its 2 tokens are all it may have
    with httpx.stream("POST", url + "/v1/completions", json=BODY | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines.count(": keepalive") >= 3 and lines[-1] == "data: [DONE]"
    # Anthropic's stream: message_start once the request is scheduled, then pings (events:
    # Claude Code times out between events), as the real API; the SDK reads it as usual.
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):  # the second time, the prompt's blocks are in the prefix cache
        with client.messages.with_streaming_response.create(**chat, stream=True) as raw:
            data = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
        kinds = [d["type"] for d in data]
        first_block = kinds.index("content_block_start")
        assert kinds[0] == "message_start" and kinds[1:first_block].count("ping") >= 3
        assert set(kinds[1:first_block]) == {"ping"} and kinds[-1] == "message_stop"
        start, end = data[0]["message"]["usage"], data[-2]["usage"]
        for key in ("input_tokens", "cache_read_input_tokens"):
            assert start[key] == end[key], key  # known when scheduled, before any output
    assert start["cache_read_input_tokens"] > 0
    with client.messages.stream(**chat) as stream:
        message = stream.get_final_message()
    assert message.usage.output_tokens == 2 and message.stop_reason == "max_tokens"
    monkeypatch.setitem(faults.real, "launch", real)
    ok(url)
