"""Start `mlxserve serve` as a real uvicorn subprocess on a free localhost port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.paths import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m mlxserve.cli serve ARGS --port P`, its log in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.pop("MLXSERVE_API_KEY", None)
        full_env.pop("VLLM_API_KEY", None)
        full_env.update(env or {})
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed in stop()
        if not any(a.startswith("--kv-cache-disk") for a in args):
            # serve keeps KV blocks in the user's cache by default: a test's server starts
            # without them (another test's blocks of the same model would be hits).
            args = [*args, "--kv-cache-disk-bytes", "0"]
        cmd = [sys.executable, "-m", "mlxserve.cli", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None):
    server = ServerProcess(args, log_path, env)
    server.wait_ready()
    return server


def read_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics parsed with prometheus_client's parser: (sample name, labels) -> value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as for a counter never incremented)."""
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response has this status and an OpenAI-shaped error body; its "error" object."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def stream_events(http: httpx.Client, path: str, body: dict) -> list[dict | str]:
    """POST with stream=true: the SSE events before the final [DONE] (which must come)."""
    events = []
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events[:-1]
