"""bench/agents' logging proxy against a tiny local upstream: streaming stays unbuffered,
and each API's usage, errors, TTFT and prompt diffs are recorded (no real clients)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.agents import clients, report, traffic
from bench.agents.proxy import NetCatcher, ProxyServer, Recorder

GATE_TIMEOUT_S = 10.0


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class Upstream:
    """A starlette app on 127.0.0.1 shaped like the three APIs' answers. A stream stops
    after its first event until the test opens ``gate``: if the proxy buffered, the test
    would never see that first event."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.stream_ended = threading.Event()  # a stream's generator finished or was closed
        self.seen: list[dict] = []

        async def messages(request: Request):
            body = await request.json()
            self.seen.append(
                {
                    "path": request.url.path,
                    "query": request.url.query,
                    "beta": request.headers.get("anthropic-beta"),
                }
            )
            if body.get("fail"):
                error = {"type": "invalid_request_error", "message": "bad 'x'\nsecond line"}
                return JSONResponse({"type": "error", "error": error}, status_code=400)
            if not body.get("stream"):
                usage = {"input_tokens": 5, "cache_read_input_tokens": 0, "output_tokens": 1}
                return JSONResponse({"type": "message", "content": [], "usage": usage})

            async def events():
                try:
                    usage = {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 1}
                    start = {"type": "message_start", "message": {"usage": usage}}
                    yield sse("message_start", start)
                    while not self.gate.is_set():
                        await asyncio.sleep(0.01)
                    delta = {"type": "content_block_delta", "delta": {"type": "text_delta"}}
                    yield sse("content_block_delta", delta)
                    end = {"type": "message_delta", "usage": {"output_tokens": 7}}
                    yield sse("message_delta", end)
                    yield sse("message_stop", {"type": "message_stop"})
                finally:
                    self.stream_ended.set()

            return StreamingResponse(events(), media_type="text/event-stream")

        async def chat(request: Request):
            await request.body()
            usage = {
                "prompt_tokens": 50,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 32},
            }
            return JSONResponse({"object": "chat.completion", "choices": [], "usage": usage})

        async def responses(request: Request):
            await request.body()

            async def events():
                yield sse("response.created", {"type": "response.created", "response": {}})
                delta = {"type": "response.output_text.delta", "delta": "ok"}
                yield sse("response.output_text.delta", delta)
                usage = {
                    "input_tokens": 70,
                    "input_tokens_details": {"cached_tokens": 64},
                    "output_tokens": 2,
                }
                done = {"type": "response.completed", "response": {"usage": usage}}
                yield sse("response.completed", done)

            return StreamingResponse(events(), media_type="text/event-stream")

        app = Starlette(
            routes=[
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/responses", responses, methods=["POST"]),
            ]
        )
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> Upstream:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self._server.started
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@pytest.fixture
def proxied(tmp_path):
    with Upstream() as upstream:
        recorder = Recorder(tmp_path / "run", "claude-code", "fake")
        with ProxyServer(upstream.url, recorder) as proxy:
            yield upstream, recorder, proxy


def anthropic_body(messages: list[dict], system: str = "You are a coding agent.") -> dict:
    return {"model": "m", "system": system, "messages": messages, "stream": True}


def test_sse_is_forwarded_unbuffered_and_usage_and_ttft_recorded(proxied):
    upstream, recorder, proxy = proxied
    headers = {"anthropic-beta": "x-2025", "authorization": "Bearer secret"}
    body = anthropic_body([{"role": "user", "content": "hello world"}])
    timeout = httpx.Timeout(GATE_TIMEOUT_S)
    with httpx.stream(
        "POST",
        proxy.url + "/v1/messages?beta=true",
        json=body,
        headers=headers,
        timeout=timeout,
    ) as response:
        chunks = response.iter_raw()
        first = next(chunks)  # arrives while the upstream still holds the rest back
        assert b"message_start" in first and b"content_block_delta" not in first
        upstream.gate.set()
        rest = b"".join(chunks)
    assert b"content_block_delta" in rest and b"message_stop" in rest
    assert upstream.seen[0] == {"path": "/v1/messages", "query": "beta=true", "beta": "x-2025"}

    (record,) = recorder.records
    assert record["path"] == "/v1/messages?beta=true" and record["api"] == "anthropic"
    assert record["status"] == 200 and record["stream"] is True
    # Anthropic's prompt is input + cache reads + cache writes.
    assert (record["prompt_tokens"], record["cached_tokens"]) == (100, 90)
    assert record["output_tokens"] == 7  # message_delta's count wins
    # The content event came only after the first byte had reached the client.
    assert record["ttft_s"] > record["first_byte_s"] > 0
    assert record["total_s"] >= record["ttft_s"]
    assert record["response_bytes"] == len(first) + len(rest)

    saved = [json.loads(line) for line in recorder.bodies_path.read_text().splitlines()]
    assert json.loads(saved[0]["request_body"]) == body  # replayable as sent
    assert saved[0]["request_headers"]["authorization"] == "<redacted>"
    assert saved[0]["response_body"].encode() == first + rest
    logged = [json.loads(line) for line in recorder.records_path.read_text().splitlines()]
    assert logged == recorder.records


def wait_until(condition, timeout_s: float = GATE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_client_leaving_mid_stream_is_recorded_and_stops_the_upstream(proxied):
    upstream, recorder, proxy = proxied
    body = anthropic_body([{"role": "user", "content": "hello"}])
    with httpx.stream("POST", proxy.url + "/v1/messages", json=body, timeout=10) as response:
        first = next(response.iter_raw())
    assert b"message_start" in first  # then the client goes away, the upstream still held
    assert wait_until(lambda: len(recorder.records) == 1)
    (record,) = recorder.records
    assert record["status"] == 200 and "client disconnected" in record["upstream_error"]
    assert record["prompt_tokens"] == 100  # what came before the cut is still read
    assert report.summarize(recorder.records)["interrupted"] == 1
    # The proxy closed its upstream request: the server stops generating for nobody.
    assert upstream.stream_ended.wait(GATE_TIMEOUT_S) and not upstream.gate.is_set()


def test_chat_and_responses_usage_shapes(proxied):
    upstream, recorder, proxy = proxied
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(proxy.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 200
    responses = {"model": "m", "input": "hi", "stream": True}
    r = httpx.post(proxy.url + "/v1/responses", json=responses, timeout=10)
    assert r.status_code == 200 and b"response.completed" in r.content
    chat_rec, resp_rec = recorder.records
    assert (chat_rec["api"], chat_rec["prompt_tokens"], chat_rec["cached_tokens"]) == (
        "chat",
        50,
        32,
    )
    assert chat_rec["stream"] is False and chat_rec["ttft_s"] == chat_rec["first_byte_s"]
    assert (resp_rec["api"], resp_rec["prompt_tokens"], resp_rec["cached_tokens"]) == (
        "responses",
        70,
        64,
    )
    assert resp_rec["output_tokens"] == 2 and resp_rec["ttft_s"] is not None


def test_error_status_and_first_line_recorded(proxied):
    upstream, recorder, proxy = proxied
    body = dict(anthropic_body([{"role": "user", "content": "x"}]), fail=True)
    r = httpx.post(proxy.url + "/v1/messages", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("bad 'x'")
    (record,) = recorder.records
    assert record["status"] == 400 and record["error"] == "bad 'x'"
    assert "second line" in record["error_body"]
    summary = report.summarize(recorder.records)
    assert summary["ok"] == 0
    assert summary["non_2xx"] == [
        {"status": 400, "route": "POST /v1/messages", "error": "bad 'x'", "count": 1}
    ]


def test_unreachable_upstream_is_a_recorded_502(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
        recorder = Recorder(tmp_path, "c", "s")
        with ProxyServer(dead, recorder) as proxy:
            r = httpx.post(proxy.url + "/v1/chat/completions", json={"messages": []}, timeout=10)
    assert r.status_code == 502
    assert recorder.records[0]["status"] == 502 and recorder.records[0]["upstream_error"]


def test_prompt_diff_of_consecutive_requests_in_one_session(proxied):
    upstream, recorder, proxy = proxied
    upstream.gate.set()
    turn1 = [{"role": "user", "content": "hello world"}]
    turn2 = turn1 + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    edited = [{"role": "user", "content": "hello there"}] + turn2[1:]
    side = anthropic_body([{"role": "user", "content": "title?"}], system="Write a title.")
    for body in (anthropic_body(turn1), side, anthropic_body(turn2), anthropic_body(edited)):
        r = httpx.post(proxy.url + "/v1/messages", json=body, timeout=10)
        assert r.status_code == 200
    first, side_rec, second, third = recorder.records
    assert "prompt_diff" not in first and "prompt_diff" not in side_rec  # other session
    assert side_rec["session"] != first["session"] == second["session"] == third["session"]
    # turn 2 keeps all of turn 1 (system + 1 message) and adds two messages.
    assert second["prompt_diff"] == {"extends": True, "index": 2, "offset": 0, "parts": [2, 4]}
    diff = third["prompt_diff"]
    # Part 1 is the first message, '{"content": "hello world", "role": "user"}': the
    # texts part after '{"content": "hello ' (19 characters).
    assert (diff["extends"], diff["index"], diff["offset"]) == (False, 1, 19)
    assert "world" in diff["before"] and "there" in diff["after"]


def test_usage_shapes_and_error_lines():
    assert traffic.usage_of(
        {"input_tokens": 3, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 5}
    ) == traffic.Usage(12, 4, None)
    assert traffic.usage_of({"prompt_tokens": 9}) == traffic.Usage(9, None, None)
    assert traffic.usage_of(
        {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1}
    ) == traffic.Usage(8, 0, 1)
    chunk = b'data: {"choices": [{"delta": {"content": "x"}}], "usage": null}\n\n'
    assert [traffic.is_content_event(n, d) for n, d in traffic.sse_events(chunk)] == [True]
    assert traffic.error_line(b'{"detail": "Not Found"}') == '"Not Found"'
    assert traffic.error_line(b"plain text\nmore") == "plain text"


def test_net_catcher_refuses_and_records(tmp_path):
    with NetCatcher() as catcher:
        catcher.label = "codex-mlxserve"
        r = httpx.get("http://example.invalid/x", proxy=catcher.url, timeout=5)
        assert r.status_code == 403
    (attempt,) = catcher.attempts
    assert attempt["client"] == "codex-mlxserve"
    assert attempt["request"].startswith("GET http://example.invalid/x")


@pytest.mark.parametrize("name", clients.ALL)
def test_each_client_is_pointed_at_the_proxy_and_nowhere_else(tmp_path, name):
    env = clients.base_env(tmp_path / "home", "http://127.0.0.1:9", [tmp_path / "bin"])
    session = clients.Session("http://127.0.0.1:5555", "fix it", env, max_output_tokens=300)
    run = clients.MAKE_RUN[name](tmp_path / "bin" / name, session)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "https_proxy"):
        assert run.env[var] == "http://127.0.0.1:9"
    assert run.env["NO_PROXY"] == "127.0.0.1,localhost"
    assert run.env["HOME"] == str(tmp_path / "home")
    text = " ".join(run.argv) + json.dumps(run.env)
    config = {str(path): body for path, body in run.files.items()}
    if name == "claude-code":
        assert run.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5555"
        assert run.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
        assert run.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "300"
        assert int(run.env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) >= int(run.env["API_TIMEOUT_MS"])
    elif name == "codex":
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        toml = tomllib.loads(config[str(tmp_path / "home" / ".codex" / "config.toml")])
        provider = toml["model_providers"][toml["model_provider"]]
        assert provider["base_url"] == "http://127.0.0.1:5555/v1"
        assert provider["wire_api"] == "responses" and toml["analytics"]["enabled"] is False
        assert run.env["CODEX_HOME"] == str(tmp_path / "home" / ".codex")
    elif name == "aider":
        assert "--openai-api-base http://127.0.0.1:5555/v1" in text
        assert "--no-check-update" in text and "--analytics-disable" in text
        assert run.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    else:
        path = str(tmp_path / "home" / ".config" / "opencode" / "opencode.json")
        provider = json.loads(config[path])["provider"]["mlxserve"]
        assert provider["options"]["baseURL"] == "http://127.0.0.1:5555/v1"
    # No other host is named anywhere in what the client is given.
    hosts = {h for h in re.findall(r"https?://([^/:\"\s]+)", text + json.dumps(config))}
    assert hosts <= {"127.0.0.1", "opencode.ai"}  # opencode's $schema is a name, not fetched


@pytest.mark.parametrize("name", clients.ALL)
def test_a_follow_up_turn_continues_the_clients_last_conversation(tmp_path, name):
    env = clients.base_env(tmp_path / "home", "http://127.0.0.1:9", [tmp_path / "bin"])
    first = clients.Session("http://127.0.0.1:5555", "fix it", env)
    follow = clients.Session("http://127.0.0.1:5555", "did it pass?", env, resume=True)
    argv = clients.MAKE_RUN[name](tmp_path / "bin" / name, first).argv
    again = clients.MAKE_RUN[name](tmp_path / "bin" / name, follow).argv
    flag = {
        "claude-code": "--continue",
        "codex": "resume",
        "aider": "--restore-chat-history",
        "opencode": "--continue",
    }[name]
    assert flag not in argv and flag in again
    assert "did it pass?" in again and "fix it" not in again
    if name == "codex":  # `codex exec resume --last PROMPT`: the newest session, continued
        assert again[1:4] == ["exec", "resume", "--last"] and again[-1] == "did it pass?"
