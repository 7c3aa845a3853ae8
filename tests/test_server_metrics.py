"""/metrics (parsed with prometheus_client), counters vs the requests made, client
disconnects aborting their requests, the stats log line, and CORS when enabled."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import metric, read_metrics, start_server, wait_until

MODEL = "tiny-metrics"
ORIGIN = "http://app.example"
LONG = 30000  # max_tokens of requests that are meant to be cut short


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny"), seed=9, max_position_embeddings=32768
    )
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(model_dir), "--served-model-name", MODEL, "--log-stats-interval", "0.3"]
    args += ["--log-level", "debug"]
    s = start_server(args + ["--allowed-origins", json.dumps([ORIGIN])], log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def m(values: dict, name: str, **labels: str) -> float:
    return metric(values, name, model_name=MODEL, **labels)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return m(after, name, **labels) - m(before, name, **labels)


def idle(server) -> bool:
    v = read_metrics(server.url)
    return m(v, "vllm:num_requests_running") == 0 and m(v, "vllm:kv_cache_usage_perc") == 0


def completion(http: httpx.Client, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_parse_with_vllm_names(server, http) -> None:
    completion(http, [3, 4, 5], 2)
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    values = read_metrics(server.url)  # prometheus_client's own parser
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
    ):
        assert (name, (("model_name", MODEL),)) in values, name
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
    ):
        assert m(values, name + "_count") >= 1, name
        assert m(values, name + "_bucket", le="+Inf") == m(values, name + "_count")
    assert m(values, "vllm:request_success_total", finished_reason="length") >= 1
    assert m(values, "mlxserve:prefix_caching_enabled", reason="") == 1
    # No *_created series (issue 11): the parsed samples hold none, nor does the text.
    assert not [name for name, _ in values if name.endswith("_created")]
    assert "_created" not in r.text


def test_prefix_caching_off_is_reported_with_its_reason() -> None:
    """Never silently off: the gauge is 0 and carries the reason."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from mlxserve.server.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL, prefix_caching_off="enable_prefix_caching is False")
    text = generate_latest(metrics.registry).decode()
    (sample,) = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mlxserve:prefix_caching_enabled"
    ]
    assert sample.value == 0
    assert sample.labels == {"model_name": MODEL, "reason": "enable_prefix_caching is False"}


def test_counters_match_the_requests_made(server, http) -> None:
    before = read_metrics(server.url)
    prompts = [[7] * 5, list(range(20, 29)), list(range(40, 53))]
    max_tokens = [3, 4, 5]
    for p, k in zip(prompts, max_tokens, strict=True):
        usage = completion(http, p, k)["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(p), k)
    # A streamed chat counts the same way; its usage chunk gives its sizes.
    body = {
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    chat_usage = json.loads(lines[-1][len("data: ") :])["usage"]
    assert chat_usage["completion_tokens"] == 4
    after = read_metrics(server.url)
    num_prompt = sum(map(len, prompts)) + chat_usage["prompt_tokens"]
    num_generated = sum(max_tokens) + 4
    assert delta(before, after, "vllm:prompt_tokens_total") == num_prompt
    assert delta(before, after, "vllm:generation_tokens_total") == num_generated
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == 4
    assert delta(before, after, "vllm:request_success_total", finished_reason="stop") == 0
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(before, after, f"vllm:{name}_seconds_count") == 4
    for name in ("prefill", "decode", "inference"):
        assert delta(before, after, f"vllm:request_{name}_time_seconds_count") == 4
    # One inter-token gap per token after the first.
    for name in ("inter_token_latency", "time_per_output_token"):
        assert delta(before, after, f"vllm:{name}_seconds_count") == num_generated - 4
    assert delta(before, after, "vllm:request_prompt_tokens_sum") == num_prompt
    assert delta(before, after, "vllm:request_generation_tokens_sum") == num_generated
    assert delta(before, after, "vllm:prefix_cache_queries_total") == num_prompt
    assert m(after, "vllm:num_requests_running") == 0
    assert m(after, "vllm:kv_cache_usage_perc") == 0


def test_prefix_cache_hits_are_counted_and_reported_in_usage(server, http) -> None:
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 + 8
    before = read_metrics(server.url)
    first = completion(http, prompt, 2)["usage"]
    second = completion(http, prompt, 2)["usage"]
    after = read_metrics(server.url)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 32
    assert delta(before, after, "vllm:prefix_cache_hits_total") == 32
    assert delta(before, after, "vllm:prefix_cache_queries_total") == 80
    assert delta(before, after, "mlxserve:prefix_cache_requests_total") == 2
    assert delta(before, after, "mlxserve:prefix_cache_requests_hit_total") == 1
    # --log-level debug: where the second prompt left the cache.
    assert "32 of 40 prompt tokens cached (pool); the cache ends at token 32" in server.log()
    # /cache/stats: the same counters since start, and the blocks the gauges show.
    (stats,) = http.get("/cache/stats").json()["data"]
    assert stats["model"] == MODEL and stats["enabled"] and stats["block_size"] == 16
    assert stats["hit_tokens"] == m(after, "vllm:prefix_cache_hits_total")
    assert stats["query_tokens"] == m(after, "vllm:prefix_cache_queries_total")
    assert stats["hit_rate"] == stats["hit_tokens"] / stats["query_tokens"]
    (pool,) = stats["tiers"]
    assert pool["name"] == "pool" and pool["num_cached_blocks"] >= 2  # the prompt's 2 blocks
    assert pool["cached_bytes"] == pool["num_cached_blocks"] * pool["bytes_per_block"] > 0
    assert m(after, "mlxserve:prefix_cache_blocks", tier="pool") == pool["num_cached_blocks"]
    assert m(after, "mlxserve:prefix_cache_bytes", tier="pool") == pool["cached_bytes"]


def test_streaming_client_disconnect_aborts_and_frees_blocks(server, http) -> None:
    before = read_metrics(server.url)
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept alive: dropping it would close the connection
            chunks = 0
            for line in lines:
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break
            during = read_metrics(server.url)
            assert m(during, "vllm:num_requests_running") == 1
            assert m(during, "vllm:kv_cache_usage_perc") > 0
    # The connection is closed: the request must be aborted, its blocks freed.
    assert wait_until(lambda: idle(server), timeout=30)
    after = read_metrics(server.url)
    assert delta(before, after, "vllm:request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == 0
    assert delta(before, after, "vllm:generation_tokens_total") < LONG


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(server) -> None:
    before = read_metrics(server.url)
    body = {"prompt": [9, 8, 7, 6], "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    assert wait_until(lambda: idle(server), timeout=30)
    after = read_metrics(server.url)
    assert delta(before, after, "vllm:request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "vllm:generation_tokens_total") < LONG
    # And the server goes on serving.
    assert completion(httpx.Client(base_url=server.url), [1, 2, 3], 2)["usage"]["total_tokens"] == 5


def test_periodic_stats_log_line(server, http) -> None:
    completion(http, [11, 12, 13], 3)

    def logged() -> bool:
        return any(
            "Running:" in line
            and "Waiting:" in line
            and "KV cache usage:" in line
            and "Prompt throughput:" in line
            and "Generation throughput:" in line
            and "Prefix cache hit rate:" in line
            for line in server.log().splitlines()
        )

    assert wait_until(logged, timeout=10)


def test_cors_headers_only_for_allowed_origins(http) -> None:
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = http.options(
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = http.get("/v1/models", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in r.headers


def test_a_step_longer_than_the_log_interval_is_named(monkeypatch) -> None:
    """A chunk of a 20k-token prompt can compute for minutes on a CPU: the stats lines of
    that time say a step is computing, not just "0.0 tokens/s" (read as a stall)."""
    from types import SimpleNamespace

    from mlxserve.core.scheduler_output import SchedulerStats
    from mlxserve.engine.cache_stats import CacheStats
    from mlxserve.server import metrics as metrics_module

    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    m = metrics_module.ServerMetrics("tiny")
    assert m.log_line() is None  # idle; the next window starts on this clock
    stats = SchedulerStats(1, 0, 0.1, 0, 0, 0)  # one request running
    cache = CacheStats(True, 16, (), 0, 0, 0, 0)
    engine = SimpleNamespace(
        get_stats=lambda: stats, cache_stats=lambda: cache, num_prompt_tokens_computed=2048
    )
    clock[0] += 5
    m.on_step(engine, [])  # a 2048-token chunk ends
    clock[0] += 5
    first = m.log_line()
    assert "Prompt throughput: 204.8 tokens/s" in first and "Step computing" not in first
    clock[0] += 10  # the next chunk is still computing at the next line, and the one after
    assert "Prompt throughput: 0.0 tokens/s, " in m.log_line()
    clock[0] += 10
    assert m.log_line().endswith(", Step computing for 25 s (a long prompt's chunk)")
    m.on_step(engine, [])  # it ends
    clock[0] += 10
    assert "Step computing" not in m.log_line()
