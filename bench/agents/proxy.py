"""A logging reverse proxy between one coding-agent client and one server, on 127.0.0.1.

It forwards every request as it came (the body whole, the response streamed chunk by
chunk as the upstream sends it, so SSE stays unbuffered) and records per request: the
path, status, the usage's prompt and cached tokens, the time to the first body byte and
to the first content event, the total time, the sizes, the error of a non-2xx, and for
consecutive requests of one conversation where their prompts first differ
(bench/agents/traffic.py). Bodies go to ``bodies.jsonl`` so a run can be replayed.

Also here: :class:`NetCatcher`, the closed door the clients' HTTP(S)_PROXY points at.
It answers every connection with a 403 and records the first line (``CONNECT host:443``),
so a client's attempt to reach any other host fails locally at once and is seen.
"""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from bench.agents import traffic

# Not forwarded: they describe one hop, not the message (RFC 9110 7.6.1), or are redone.
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
SECRET_HEADERS = {"authorization", "x-api-key", "api-key"}
ERROR_BODY_CHARS = 4000
CLIENT_CLOSED = 499  # nginx's status for a request its client gave up on before an answer


class Recorder:
    """Per-request records of one client x server run, and the bodies, as JSONL."""

    def __init__(self, out_dir: Path, client: str, server: str) -> None:
        self.client, self.server = client, server
        out_dir.mkdir(parents=True, exist_ok=True)
        self.records_path = out_dir / "requests.jsonl"
        self.bodies_path = out_dir / "bodies.jsonl"
        self.records: list[dict[str, Any]] = []
        self._last_prompt: dict[str, list[str]] = {}  # session key -> its latest prompt
        self._lock = threading.Lock()

    def add(
        self,
        *,
        method: str,
        path: str,
        request_headers: dict[str, str],
        request_body: bytes,
        status: int,
        response_headers: dict[str, str],
        response_body: bytes,
        started: float,
        first_byte_s: float | None,
        content_s: float | None,
        total_s: float,
        upstream_error: str | None = None,
    ) -> dict[str, Any]:
        api = traffic.api_of(path)
        content_type = response_headers.get("content-type", "")
        usage = traffic.response_usage(response_body, content_type)
        try:
            request = json.loads(request_body) if request_body else {}
        except ValueError:
            request = {}
        with self._lock:
            record: dict[str, Any] = {
                "n": len(self.records),
                "client": self.client,
                "server": self.server,
                "method": method,
                "path": path,
                "api": api,
                "model": request.get("model") if isinstance(request, dict) else None,
                "stream": "text/event-stream" in content_type,
                "status": status,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "output_tokens": usage.output_tokens,
                "first_byte_s": first_byte_s,
                # TTFT: the first content event of a stream; a whole body counts when it comes.
                "ttft_s": content_s if content_s is not None else first_byte_s,
                "total_s": total_s,
                "request_bytes": len(request_body),
                "response_bytes": len(response_body),
                "started": started,
            }
            if upstream_error:
                record["upstream_error"] = upstream_error
            if not 200 <= status < 300:
                record["error"] = traffic.error_line(response_body)
                record["error_body"] = response_body.decode("utf-8", "replace")[:ERROR_BODY_CHARS]
            if isinstance(request, dict) and api in ("anthropic", "responses", "chat"):
                parts = traffic.prompt_parts(api, request)
                key = traffic.session_key(api, parts)
                record["session"] = key
                record["prompt_parts"] = len(parts)
                if key in self._last_prompt:
                    record["prompt_diff"] = traffic.prompt_diff(self._last_prompt[key], parts)
                self._last_prompt[key] = parts
            self.records.append(record)
            with self.records_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bodies = {
                "n": record["n"],
                "client": self.client,
                "server": self.server,
                "method": method,
                "path": path,
                "request_headers": {
                    k: ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                    for k, v in request_headers.items()
                },
                "request_body": request_body.decode("utf-8", "replace"),
                "status": status,
                "response_headers": response_headers,
                "response_body": response_body.decode("utf-8", "replace"),
            }
            with self.bodies_path.open("a") as f:
                f.write(json.dumps(bodies) + "\n")
            return record


class _ContentClock:
    """Finds the first content event in a stream as its chunks arrive."""

    def __init__(self) -> None:
        self.buffer = b""
        self.found = False

    def feed(self, chunk: bytes) -> bool:
        """True once an event that carries content has been completed by this chunk."""
        if self.found:
            return False
        self.buffer = (self.buffer + chunk).replace(b"\r\n", b"\n")
        head, sep, rest = self.buffer.rpartition(b"\n\n")
        if not sep:
            return False
        self.buffer = rest
        if any(traffic.is_content_event(n, d) for n, d in traffic.sse_events(head)):
            self.found = True
        return self.found


def make_app(upstream: str, recorder: Recorder, read_timeout_s: float = 1800.0):
    """The ASGI app that forwards to ``upstream`` (http://host:port) and records."""
    state: dict[str, httpx.AsyncClient] = {}
    timeout = httpx.Timeout(connect=10.0, read=read_timeout_s, write=60.0, pool=60.0)

    def client() -> httpx.AsyncClient:
        if "client" not in state:  # made inside the serving loop
            state["client"] = httpx.AsyncClient(timeout=timeout, trust_env=False)
        return state["client"]

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if "client" in state:
                        await state.pop("client").aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        started, t0 = time.time(), time.perf_counter()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in HOP_HEADERS
        }
        # The proxy reads the bodies: ask for them uncompressed.
        headers = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
        headers["accept-encoding"] = "identity"
        request = client().build_request(
            scope["method"], upstream + path, headers=headers, content=body
        )
        chunks: list[bytes] = []
        first_byte = content = None
        status, response_headers, error = 502, {"content-type": "application/json"}, None
        response_started = recorded = False

        def record() -> None:
            recorder.add(
                method=scope["method"],
                path=path,
                request_headers=headers,
                request_body=body,
                status=status,
                response_headers=response_headers,
                response_body=b"".join(chunks),
                started=started,
                first_byte_s=first_byte,
                content_s=content,
                total_s=time.perf_counter() - t0,
                upstream_error=error,
            )

        # A client that goes away (killed at its time limit) must not leave the server
        # generating for nobody: its disconnect cancels the forwarding.
        forwarding = asyncio.current_task()
        left = asyncio.Event()

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()
            if forwarding is not None:
                forwarding.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            try:
                response = await client().send(request, stream=True)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
                payload = json.dumps({"error": {"message": f"proxy: upstream: {error}"}})
                chunks.append(payload.encode())
                start = {"type": "http.response.start", "status": status}
                await send(start | {"headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": chunks[0]})
            else:
                response_started = True
                status = response.status_code
                response_headers = {k.lower(): v for k, v in response.headers.items()}
                out_headers = [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in response.headers.items()
                    # Sent chunked (no content-length): the client sees the end only after
                    # the record is written, so whoever reads the records after a response
                    # finds it there.
                    if k.lower() not in HOP_HEADERS
                ]
                await send(
                    {"type": "http.response.start", "status": status, "headers": out_headers}
                )
                clock = _ContentClock()
                try:
                    async for chunk in response.aiter_raw():
                        now = time.perf_counter() - t0
                        if first_byte is None:
                            first_byte = now
                        if clock.feed(chunk):
                            content = now
                        chunks.append(chunk)
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__} while streaming: {exc}"
                finally:
                    await response.aclose()
            # Recorded before the response ends, so a client that saw it end finds the record.
            record()
            recorded = True
            if response_started:
                await send({"type": "http.response.body", "body": b""})
        except BaseException as exc:  # the client left, or the proxy is stopping mid-stream
            if not recorded:
                why = "client disconnected" if left.is_set() else f"{type(exc).__name__}: {exc}"
                error = f"interrupted ({why}) after {len(chunks)} chunks"
                if not response_started:
                    status = CLIENT_CLOSED  # no answer had begun: not the server's error
                record()
            if not left.is_set():
                raise
        finally:
            watcher.cancel()

    return app


class ProxyServer:
    """The proxy app served by uvicorn in a thread on 127.0.0.1 (a context manager)."""

    def __init__(self, upstream: str, recorder: Recorder, read_timeout_s: float = 1800.0):
        self.recorder = recorder
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            make_app(upstream, recorder, read_timeout_s),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=600,  # an agent waits long between turns on a slow prefill
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> ProxyServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the logging proxy did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout=5)
        self._sock.close()


class _CatchHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(2.0)
        try:
            line = self.request.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
        except OSError:
            line = ""
        catcher: NetCatcher = self.server.catcher  # type: ignore[attr-defined]
        catcher.attempts.append({"client": catcher.label, "time": time.time(), "request": line})
        try:
            self.request.sendall(
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
        except OSError:
            pass


class NetCatcher:
    """A local HTTP proxy that refuses everything and records what was asked of it."""

    def __init__(self) -> None:
        self.label = ""
        self.attempts: list[dict[str, Any]] = []
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _CatchHandler)
        self._server.daemon_threads = True
        self._server.catcher = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> NetCatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
