"""Prometheus metrics with vLLM's names (so its Grafana dashboards work) and a periodic log line.

ServerMetrics.on_step runs on the engine thread after every step (AsyncLLM's on_step
hook) and after aborts; /metrics renders the registry from the event loop. Counting rules
follow vLLM: a request's prompt tokens are counted when its first token is produced,
every generated token once, and each finished sample adds 1 to request_success_total
under its finish reason (stop / length / abort).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mlxserve.core.request import RequestMetrics, RequestOutput

logger = logging.getLogger("mlxserve")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _WithoutCreated:
    """A registry's metrics without the ``*_created`` timestamps prometheus_client adds to
    counters and histograms: one more series per metric that dashboards never read.
    (prometheus_client.disable_created_metrics() would change every registry in the process.)
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


@dataclass
class _Live:
    """What the metrics remember about a request that has not finished."""

    last_token_time: float | None = None
    has_tokens: bool = False
    num_generated: int = 0


@dataclass
class _Window:
    """Counts since the last log line."""

    start: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0  # computed (prefilled) tokens, cache hits excluded
    num_generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    draft_tokens: int = 0  # speculative decoding: drafted tokens verified
    accepted_tokens: int = 0


class ServerMetrics:
    """One model's metrics in the server's Prometheus registry, fed from its engine thread.

    Several models share one registry (``for_model``): each metric is one family, and each
    model its ``model_name`` label."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefix_caching_off: str | None = None,
        speculative: bool = False,
        families: dict[str, Any] | None = None,
    ) -> None:
        """``prefix_caching_off``: why the engine does not cache prefixes (None: it does);
        ``speculative``: the engine speculates (vLLM's spec_decode counters are exported);
        ``families``: the metric families of ``registry`` made already (another model's)."""
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self._families = {} if families is None else families
        r, labels = self.registry, ["model_name"]

        def family(kind: type, name: str, doc: str, labelnames: list[str], **kw: Any) -> Any:
            if name not in self._families:
                self._families[name] = kind(name, doc, labelnames, registry=r, **kw)
            return self._families[name]

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge, name, doc, labels).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc, labels).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return family(Histogram, name, doc, labels, buckets=buckets).labels(model_name)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # vLLM's older name, still read by its example Grafana dashboard.
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of tokens."
        )
        self.prefix_cache_requests = counter(
            "mlxserve:prefix_cache_requests", "Requests looked up in the prefix cache."
        )
        self.prefix_cache_requests_hit = counter(
            "mlxserve:prefix_cache_requests_hit", "Requests that found part of their prompt."
        )
        tier_labels = ["model_name", "tier"]
        self.prefix_cache_blocks = family(
            Gauge, "mlxserve:prefix_cache_blocks", "Blocks held by the prefix cache.", tier_labels
        )
        self.prefix_cache_bytes = family(
            Gauge, "mlxserve:prefix_cache_bytes", "Bytes of K/V held by the prefix cache.",
            tier_labels,
        )  # fmt: skip
        self._requests = (0, 0)
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        # Never silently off: 1 when on, else 0 with the reason as a label.
        family(
            Gauge,
            "mlxserve:prefix_caching_enabled",
            "1 if automatic prefix caching is on; 0 with the reason why not.",
            ["model_name", "reason"],
        ).labels(model_name, prefix_caching_off or "").set(0 if prefix_caching_off else 1)
        self.speculative = speculative
        if speculative:
            self.spec_decode_num_drafts = counter(
                "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
            )
            self.spec_decode_num_draft_tokens = counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
            )
            self.spec_decode_num_accepted_tokens = counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
            )
            self.spec_decode_enabled = gauge(
                "mlxserve:spec_decode_enabled",
                "1 if the last step could propose drafts (not backed off by batch size or "
                "by cost per token).",
            )
            self.spec_decode_cost_switches = counter(
                "mlxserve:spec_decode_cost_switches",
                "Times the cost back-off turned speculation on or off.",
            )
            self._cost_switches = 0
        self._spec = (0, 0, 0)  # cumulative drafts, draft tokens, accepted tokens
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = family(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS
        )
        # The same gaps under vLLM's older name (its example dashboard plots this one).
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token (inter-token latency).",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", E2E_BUCKETS
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            E2E_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            E2E_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            E2E_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            E2E_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        )
        self._live: dict[str, _Live] = {}
        self._prompt_tokens_computed = 0
        self._lock = threading.Lock()
        self._window = _Window()
        self._was_idle = True  # the last log line reported nothing happening
        self._cumulative = (0, 0)  # prefix queries, hits
        self._num_preemptions = 0
        self._gauges = (0, 0, 0.0)  # running, waiting, kv usage
        self._last_step = time.monotonic()  # when the engine last finished a step

    def for_model(
        self, model_name: str, prefix_caching_off: str | None = None, speculative: bool = False
    ) -> ServerMetrics:
        """Metrics of one more model (or of a model loaded again: its counters go on), in
        this registry under its own ``model_name`` label."""
        return ServerMetrics(
            model_name, self.registry, prefix_caching_off, speculative, self._families
        )

    # -------------------------------------------------------------- engine thread
    def on_step(self, engine, outputs: list[RequestOutput]) -> None:
        """AsyncLLM's hook; never raises (an error here must not stop the engine)."""
        try:
            self._update(engine, outputs)
        except Exception:  # noqa: BLE001
            logger.exception("metrics update failed")

    def _update(self, engine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        stats = engine.get_stats()
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        last_q, last_h = self._cumulative
        self.prefix_cache_queries.inc(max(0, queries - last_q))
        self.prefix_cache_hits.inc(max(0, hits - last_h))
        cache = engine.cache_stats()
        requests = (cache.num_requests, cache.num_requests_hit)
        self.prefix_cache_requests.inc(max(0, requests[0] - self._requests[0]))
        self.prefix_cache_requests_hit.inc(max(0, requests[1] - self._requests[1]))
        self._requests = requests
        for tier in cache.tiers:
            self.prefix_cache_blocks.labels(self.model_name, tier.name).set(tier.num_cached_blocks)
            self.prefix_cache_bytes.labels(self.model_name, tier.name).set(tier.cached_bytes)
        self.num_preemptions.inc(max(0, stats.num_preemptions - self._num_preemptions))
        self._num_preemptions = stats.num_preemptions
        spec = (
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
        )
        last_spec, self._spec = self._spec, spec
        if self.speculative:
            self.spec_decode_num_drafts.inc(max(0, spec[0] - last_spec[0]))
            self.spec_decode_num_draft_tokens.inc(max(0, spec[1] - last_spec[1]))
            self.spec_decode_num_accepted_tokens.inc(max(0, spec[2] - last_spec[2]))
            self.spec_decode_enabled.set(1 if stats.spec_decode_enabled else 0)
            switches = stats.spec_decode_cost_switches
            self.spec_decode_cost_switches.inc(max(0, switches - self._cost_switches))
            self._cost_switches = switches
        computed = engine.num_prompt_tokens_computed
        with self._lock:
            w = self._window
            w.draft_tokens += spec[1] - last_spec[1]
            w.accepted_tokens += spec[2] - last_spec[2]
            w.prefix_queries += queries - last_q
            w.prefix_hits += hits - last_h
            w.num_prompt_tokens += computed - self._prompt_tokens_computed
            self._prompt_tokens_computed = computed
            self._cumulative = (queries, hits)
            self._gauges = (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
            self._last_step = now
        for out in outputs:
            self._observe(out, now)

    def _observe(self, out: RequestOutput, now: float) -> None:
        rid, m = out.request_id, out.metrics
        aborted = any(c.finish_reason == "abort" for c in out.outputs)
        # An abort's output is cumulative, not a delta: its tokens were counted already.
        num_new = 0 if aborted else sum(len(c.token_ids) for c in out.outputs)
        live = self._live.setdefault(rid, _Live())
        # An embedding finishes with its prompt computed and no token: count the prompt then.
        if (num_new or out.embedding is not None) and not live.has_tokens:
            live.has_tokens = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            if m is not None and m.first_scheduled_time is not None:
                self.request_queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if num_new:
            self.generation_tokens.inc(num_new)
            with self._lock:
                self._window.num_generation_tokens += num_new
            live.num_generated += num_new
            if live.last_token_time is None:
                if m is not None and m.first_token_time is not None:
                    self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
            else:
                self.inter_token_latency.observe(now - live.last_token_time)
                self.time_per_output_token.observe(now - live.last_token_time)
            live.last_token_time = now
        if out.finished:
            for c in out.outputs:
                self._request_success.labels(self.model_name, c.finish_reason).inc()
            if m is not None:
                self._observe_phases(m, now)
            self.request_generation_tokens.observe(live.num_generated)
            self._live.pop(rid, None)

    def _observe_phases(self, m: RequestMetrics, now: float) -> None:
        finished = m.finished_time or now
        self.e2e_request_latency.observe(finished - m.arrival_time)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.request_prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            self.request_decode_time.observe(finished - m.first_token_time)
            self.request_inference_time.observe(finished - m.first_scheduled_time)

    # ---------------------------------------------------------------- event loop
    def render(self) -> bytes:
        """The registry in Prometheus text format (without ``_created`` series)."""
        return generate_latest(_WithoutCreated(self.registry))

    def log_line(self) -> str | None:
        """The periodic stats line (None when idle since the last one)."""
        now = time.monotonic()
        with self._lock:
            w, self._window = self._window, _Window(start=now)
            running, waiting, kv = self._gauges
            total_q, total_h = self._cumulative
            last_step = self._last_step
        idle = not (running or waiting or w.num_prompt_tokens or w.num_generation_tokens)
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        elapsed = max(now - w.start, 1e-9)
        queries, hits = w.prefix_queries, w.prefix_hits
        if not queries:  # nothing looked up lately: the rate since start
            queries, hits = total_q, total_h
        hit_rate = 100.0 * hits / queries if queries else 0.0
        line = (
            f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {100 * kv:.1f}%, "
            f"Prompt throughput: {w.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Generation throughput: {w.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if running and last_step < w.start:  # no step ended in this window: say why
            line += f", Step computing for {now - last_step:.0f} s (a long prompt's chunk)"
        if self.speculative:
            rate = 100.0 * w.accepted_tokens / w.draft_tokens if w.draft_tokens else 0.0
            line += (
                f", Draft acceptance rate: {rate:.1f}% "
                f"({w.accepted_tokens} of {w.draft_tokens} draft tokens)"
            )
        return line
