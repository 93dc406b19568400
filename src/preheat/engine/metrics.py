"""Prometheus exposition of the simulated engine with vLLM's metric names.

Counters and gauges are read from the scheduler and KV cache at scrape time (nothing is
updated per token); only the latency histograms are observed per request. Names and
units follow vLLM v1 (``vllm/v1/metrics/loggers.py``) so routers and dashboards written
for vLLM read this engine unchanged:

==========================================  =========  =========================================
``vllm:prefix_cache_queries_total``         counter    prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``            counter    of those, tokens found cached
``vllm:num_requests_running``               gauge      sequences in the running batch
``vllm:num_requests_waiting``               gauge      sequences queued (incl. preempted)
``vllm:kv_cache_usage_perc``                gauge      fraction of KV blocks in use, 0..1
``vllm:num_preemptions_total``              counter    sequences preempted (recompute)
``vllm:prompt_tokens_total``                counter    prompt tokens of admitted requests
``vllm:generation_tokens_total``            counter    output tokens produced
``vllm:request_success_total``              counter    finished requests, by finished_reason
``vllm:time_to_first_token_seconds``        histogram  arrival to first output token
``vllm:e2e_request_latency_seconds``        histogram  arrival to last output token
``vllm:cache_config_info``                  gauge      1, with the KV cache's ``block_size`` and
                                                       ``num_gpu_blocks`` (and prefix caching) as
                                                       labels, as vLLM's ``CacheConfig`` exports
                                                       them; routers size their model of this
                                                       engine's KV LRU from it
==========================================  =========  =========================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .core.scheduler import Scheduler

__all__ = ["EngineMetrics"]

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _SchedulerCollector(Collector):
    def __init__(self, sched: Scheduler, model: str) -> None:
        self._s = sched
        self._model = model
        self.success: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        s, labels, lv = self._s, ["model_name"], [self._model]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lv, value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(name, doc, labels=labels)
            m.add_metric(lv, value)
            return m

        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [str(s.kv.block_size), str(s.kv.num_blocks), str(s.kv.enable_prefix_caching)], 1.0
        )
        yield info
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", s.kv.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", s.kv.hits)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv.usage)
        yield counter("vllm:num_preemptions", "Cumulative preemptions.", s.num_preemptions)
        yield counter(
            "vllm:prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens_total
        )
        yield counter("vllm:generation_tokens", "Generated tokens.", s.generation_tokens_total)
        m = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests.",
            labels=["model_name", "finished_reason"],
        )
        for reason, n in sorted(self.success.items()):
            m.add_metric([self._model, reason], n)
        yield m


class EngineMetrics:
    """The engine's registry: scrape-time counters plus per-request latency histograms."""

    def __init__(self, sched: Scheduler, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _SchedulerCollector(sched, model)
        self.registry.register(self._collector)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model)

    def finished(self, reason: str) -> None:
        self._collector.success[reason] = self._collector.success.get(reason, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
