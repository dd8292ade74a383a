"""Prometheus metrics: engine gauges read at scrape time, latency histograms observed live.

Gauges come from `engine.stats()` when scraped rather than being pushed on every step, so the
engine loop pays nothing for them; time to first token and inter-token latency can only be
seen as tokens arrive, so the serving path observes those itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from shoal.engine.protocol import EngineProtocol
    from shoal.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Reads `engine.stats()` on each scrape: every field becomes the gauge or counter its
    metadata names; tokens/s is the rate since the previous scrape."""

    def __init__(self, engine: EngineProtocol) -> None:
        self.engine = engine
        self._last = (time.monotonic(), 0)

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        for f in dataclasses.fields(s):
            name = f"shoal_{f.metadata['metric'] or f.name}"
            if "label" in f.metadata:
                family = GaugeMetricFamily(name, f.metadata["doc"], labels=[f.metadata["label"]])
                for key, level in sorted(getattr(s, f.name).items()):
                    family.add_metric([key], float(level))
                yield family
                continue
            value = float(getattr(s, f.name))
            if f.metadata["kind"] == "counter":
                yield CounterMetricFamily(name, f.metadata["doc"], value=value)
            else:
                yield GaugeMetricFamily(name, f.metadata["doc"], value=value)
        now = time.monotonic()
        t0, n0 = self._last
        rate = (s.num_generated_tokens - n0) / (now - t0) if now > t0 else 0.0
        self._last = (now, s.num_generated_tokens)
        yield GaugeMetricFamily(
            "shoal_generation_tokens_per_second",
            "Generated tokens per second since the previous scrape.",
            value=max(0.0, rate),
        )


class ServerMetrics:
    """One registry per app, so several servers can live in one process (tests)."""

    def __init__(self, engine: EngineProtocol, server: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram(
            "shoal_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "shoal_inter_token_latency_seconds",
            "Time between successive generated tokens.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "shoal_requests",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.schema_refusals = Counter(
            "shoal_schema_refusals",
            "Requests refused (400) for a JSON schema or constraint, by reason: limit, strict, "
            "unmatchable, not_object (checked before compiling) or compile (it does not "
            "compile, or costs more than the compile budget).",
            ["reason"],
            registry=self.registry,
        )
        self.batch_requests = Counter(
            "shoal_batch_requests",
            "Batch API requests by outcome (completed or failed), counted once each.",
            ["outcome"],
            registry=self.registry,
        )
        info = Info("shoal_engine", "How the engine was configured.", registry=self.registry)
        c = engine.config
        info.info(
            {
                "model": engine.model_name,
                "backend": c.backend,
                "dtype": c.dtype,
                "device": c.device,
                "block_size": str(c.block_size),
                "num_blocks": str(engine.pool.num_blocks),
                "max_num_seqs": str(c.max_num_seqs),
                "max_num_batched_tokens": str(c.max_num_batched_tokens),
                "max_model_len": str(engine.max_model_len),
                "max_waiting": str(c.max_waiting),
                "prefix_caching": str(c.enable_prefix_caching).lower(),
                "session_cache_dir": c.cache_dir or "",
            }
        )
        if server is not None:
            Info("shoal_server", "How the server was configured.", registry=self.registry).info(
                server
            )

    def finished(self, out: RequestOutput | None) -> None:
        reason = out.finish_reason if out is not None and out.finish_reason else "abort"
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
