"""Prometheus metrics with SGLang's names (`sglang:*`, labelled by model_name).

Latency histograms are observed in the main process as outputs arrive. Token counters, cache hit rate, queue
lengths and KV usage belong to the scheduler process; they are read from a fresh `SchedulerSnapshot` at scrape
time and exposed through a custom collector, so the two processes never need to share counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sglang_pic.managers.ipc import SchedulerSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _SnapshotCollector:
    """Emits the scheduler's counters and gauges from the snapshot taken for the current scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: SchedulerSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        label = [self.model_name]

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", snap.prompt_tokens)
        yield counter("sglang:generation_tokens", "Number of generation tokens processed.", snap.generation_tokens)
        yield counter(
            "sglang:cached_tokens",
            "Number of prompt tokens served from the cache (prefix and span hits).",
            snap.cached_prefix_tokens + snap.cached_span_tokens,
        )
        yield counter("sglang:num_retractions", "Number of requests retracted to free KV memory.", snap.num_retractions)
        yield counter(
            "sglang:num_preemptions", "Number of running requests preempted by more urgent ones.", snap.num_preemptions
        )
        yield counter(
            "sglang:shared_decode_steps",
            "Number of steps whose decodes read each shared KV run once for all requests holding it.",
            snap.shared_decode_steps,
        )
        yield gauge("sglang:cache_hit_rate", "Share of prompt tokens served from the cache.", snap.cache_hit_rate)
        yield gauge("sglang:num_running_reqs", "Number of running requests.", snap.num_running_reqs)
        yield gauge("sglang:num_queue_reqs", "Number of requests waiting in the queue.", snap.num_waiting_reqs)
        yield gauge("sglang:token_usage", "Share of the KV pool held by requests.", snap.token_usage)
        yield gauge("sglang:num_used_tokens", "KV slots held by requests.", snap.used_tokens)
        yield gauge("sglang:num_evictable_tokens", "KV slots held only by the cache.", snap.evictable_tokens)
        yield gauge("sglang:max_total_num_tokens", "Size of the KV pool in tokens.", snap.max_total_num_tokens)
        yield gauge(
            "sglang:host_cache_tokens", "Tokens whose KV the cache keeps in host memory.", snap.host_cache_tokens
        )
        yield counter(
            "sglang:host_cache_loaded_tokens",
            "Tokens the cache brought back from host memory on a hit.",
            snap.host_cache_loaded_tokens,
        )
        if snap.spec_verify_ct == 0:
            return
        yield gauge(
            "sglang:spec_accept_length", "Tokens a request gets per speculative verification.", snap.spec_accept_length
        )
        yield gauge("sglang:spec_accept_rate", "Share of drafted tokens verification accepted.", snap.spec_accept_rate)
        yield counter("sglang:spec_verify_ct", "Request-rounds of speculative verification.", snap.spec_verify_ct)
        yield counter("sglang:spec_draft_tokens", "Tokens drafted.", snap.spec_draft_tokens)
        yield counter("sglang:spec_accepted_tokens", "Drafted tokens accepted.", snap.spec_accepted_drafts)
        yield counter("sglang:spec_draft_seconds", "Time spent drafting.", snap.spec_draft_time_s)
        yield counter("sglang:spec_verify_seconds", "Time spent verifying.", snap.spec_verify_time_s)
        yield counter(
            "sglang:spec_host_to_device_bytes", "Full KV streamed from the host tier.", snap.spec_h2d_bytes
        )


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._snapshot = _SnapshotCollector(model_name)
        self.registry.register(self._snapshot)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency.",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def on_output(
        self, meta: dict, now: float, last_time: float, seen_tokens: int, stream: bool, finished: bool
    ) -> None:
        """Record latencies for one arriving output of a request that had `seen_tokens` tokens before it.

        A streamed request's inter-token gaps are measured between arrivals; a non-streamed one arrives once, so
        its gaps are the average of its decode time, counted once per gap.
        """
        tokens = meta["completion_tokens"]
        new = tokens - seen_tokens
        if seen_tokens == 0 and new > 0 and "ttft" in meta:
            self.ttft.observe(meta["ttft"])
            if not stream and tokens > 1:
                gap = (meta["e2e_latency"] - meta["ttft"]) / (tokens - 1)
                for _ in range(tokens - 1):
                    self.itl.observe(gap)
        elif seen_tokens > 0 and new > 0:
            gap = (now - last_time) / new
            for _ in range(new):
                self.itl.observe(gap)
        if finished:
            self.e2e.observe(meta["e2e_latency"])

    def render(self, snapshot: SchedulerSnapshot | None) -> bytes:
        self._snapshot.snapshot = snapshot
        return generate_latest(self.registry)
