"""Internal failures: a 500 in OpenAI's shape (or an error event mid-stream), then the
server keeps serving. The app runs in-process under a real uvicorn so a fault can be
injected into the engine's model runner."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import uvicorn

from mlxserve.config import EngineConfig
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.engine.llm_engine import LLMEngine
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
        engine.runner.launch = lambda so: self._call("launch", so)
        engine.runner.collect = lambda step: self._call("collect", step)

    def _call(self, name: str, arg):
        self.calls[name] += 1
        if name == self.where and self.calls[name] in self.fail_at:
            raise RuntimeError("injected fault")
        return self.real[name](arg)

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

    from mlxserve.worker.model_runner import ModelRunner

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
    real = ModelRunner._read

    def read(self, part):
        if any(r.sampling_params.max_tokens == 7 for r in part.samplers):
            raise RuntimeError("injected fault")
        return real(self, part)

    monkeypatch.setattr(ModelRunner, "_read", read)
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
