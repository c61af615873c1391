"""Prometheus metrics, in a registry of the app's own (not prometheus_client's global one, so
two apps in a process, or the tests, never share counts).

HTTP: requests by route, method and status; latency by route. Engine (read from its stats at
each scrape, between two steps): requests running and waiting, tokens, prefix-cache hit rate,
KV-cache use; and the server's own in-flight prompts, cancelled requests and running Batch API
batches."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .state import ServerState

# generate_latest writes the 0.0.4 text format (CONTENT_TYPE_LATEST names 1.0.0 in prometheus_client 0.26).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, state: "ServerState"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("batchprompt_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("batchprompt_http_request_duration_seconds",
                                 "Time from request to the response's last byte, by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(state))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        """The text exposition (blocking: it reads the engine's stats; call from a thread)."""
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, state: "ServerState"):
        self.state = state

    def describe(self):
        return []  # collected at scrape time only (the engine may not be loaded yet)

    def collect(self):
        state = self.state
        yield _gauge("batchprompt_model_loaded", "1 once the model is loaded and the server ready",
                     float(state.ready))
        yield _gauge("batchprompt_server_requests_in_flight", "HTTP requests being answered by the engine",
                     state.requests_in_flight())
        yield _gauge("batchprompt_server_prompts_pending",
                     "Prompts of in-flight HTTP requests not answered yet (queued or running)",
                     state.prompts_pending())
        yield _gauge("batchprompt_batch_api_batches_running",
                     "Batch API batches being run (validating, in progress, finalizing or cancelling)",
                     state.batch_api.running())
        cancelled = CounterMetricFamily("batchprompt_server_requests_cancelled",
                                        "Requests cancelled before they finished, by reason", labels=["reason"])
        for reason in ("client_disconnected", "shutdown"):
            cancelled.add_metric([reason], state.cancelled[reason])
        yield cancelled
        s = state.engine_stats()
        if s is None:
            return
        yield _gauge("batchprompt_requests_running", "Requests running in the engine", s.running)
        yield _gauge("batchprompt_requests_waiting", "Queue depth: requests in the engine waiting to run", s.waiting)
        yield _counter("batchprompt_requests_finished", "Requests the engine finished", s.finished)
        yield _counter("batchprompt_requests_failed", "Requests the engine failed", s.failed)
        yield _counter("batchprompt_generation_tokens", "Tokens generated", s.decode_tokens)
        yield _counter("batchprompt_prompt_tokens", "Prompt tokens of admitted requests", s.prompt_tokens)
        yield _counter("batchprompt_prompt_tokens_cached", "Prompt tokens served by the prefix cache",
                       s.cached_prompt_tokens)
        yield _counter("batchprompt_preemptions", "Requests preempted for KV memory", s.preemptions)
        yield _gauge("batchprompt_generation_tokens_per_second",
                     "Generated tokens per second of engine time (rate(batchprompt_generation_tokens_total) "
                     "gives the wall-clock rate)", s.decode_tokens_per_s)
        yield _gauge("batchprompt_prefix_cache_hit_rate", "Share of prompt tokens served by the prefix cache",
                     s.prefix_cache_hit_rate)
        yield _gauge("batchprompt_kv_cache_usage", "Share of the KV-cache blocks in use",
                     s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield _gauge("batchprompt_kv_cache_blocks_used", "KV-cache blocks in use", s.kv_blocks_used)
        yield _gauge("batchprompt_kv_cache_blocks_total", "KV-cache blocks the budget allows", s.kv_blocks_total)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
