"""`serve --speculative-config`: the flag reaches the engine, /metrics exports vLLM's
spec_decode counters, and the stats log line reports the acceptance rate."""

from __future__ import annotations

import json

import httpx
import pytest

from mlxserve.cli.engine_args import engine_config
from mlxserve.cli.main import build_parser
from mlxserve.config import SpeculativeConfig
from mlxserve.exceptions import ParameterError
from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import metric, read_metrics, start_server, wait_until

MODEL = "tiny-spec"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_the_flag_reaches_the_engine_config() -> None:
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    config = engine_config(args, None)
    assert config.speculative_config == SpeculativeConfig(**SPEC)
    bad = build_parser().parse_args(["serve", "--speculative-config", '{"method": "x"}'])
    with pytest.raises(ParameterError) as e:
        engine_config(bad, None)
    assert e.value.parameter == "speculative_config.method"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(model_dir), "--served-model-name", MODEL, "--log-stats-interval", "0.3"]
    s = start_server(args + ["--speculative-config", json.dumps(SPEC)], log)
    yield s
    s.stop()


def test_spec_decode_counters_and_log_line(server) -> None:
    def m(values: dict, name: str) -> float:
        return metric(values, name, model_name=MODEL)

    before = read_metrics(server.url)
    # A prompt repeating a span: the tiny model's greedy output loops, n-gram drafts pass.
    prompt = [30, 280, 32, 32, 32, 32, 32, 32, 293] * 3
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 32
    after = read_metrics(server.url)
    drafts, tokens, accepted = (
        m(after, f"vllm:spec_decode_num_{n}_total") - m(before, f"vllm:spec_decode_num_{n}_total")
        for n in ("drafts", "draft_tokens", "accepted_tokens")
    )
    assert 1 <= drafts <= tokens <= 3 * drafts
    assert 0 < accepted <= tokens
    assert (
        m(after, "vllm:generation_tokens_total") - m(before, "vllm:generation_tokens_total") == 32
    )

    def logged() -> bool:
        return any("Draft acceptance rate:" in line for line in server.log().splitlines())

    assert wait_until(logged, timeout=10)
