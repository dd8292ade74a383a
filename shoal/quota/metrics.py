"""Prometheus metrics of a quota service: what reserves and completes decided, counted as
they happen, and what every limit holds, read from the backend when scraped.

`shoal quota serve` serves them at `/metrics`; `shoal serve --quota` adds them to its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.quota.errors import QuotaError
from shoal.quota.types import CompleteResult, ReserveResult

if TYPE_CHECKING:
    from shoal.quota.service import QuotaService


def _code(error: str) -> str:
    """An item's error without the limit key it may carry (`exceeds_capacity:<key>`)."""
    return error.partition(":")[0]


class _Usage(Collector):
    """Each limit's holding, capacity and window, read from the backend on each scrape."""

    def __init__(self, service: QuotaService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        labels = ["key", "kind"]
        used = GaugeMetricFamily(
            "shoal_quota_limit_used",
            "What a limit holds now: amounts in its rolling window, or concurrency slots.",
            labels=labels,
        )
        capacity = GaugeMetricFamily(
            "shoal_quota_limit_capacity", "A limit's capacity.", labels=labels
        )
        window = GaugeMetricFamily(
            "shoal_quota_limit_window_seconds",
            "A rate limit's rolling window (a concurrency hold's lifetime).",
            labels=labels,
        )
        up = GaugeMetricFamily("shoal_quota_backend_up", "1 if the backend answered the scrape.")
        try:
            rows = self.service.usage()
            up.add_metric([], 1)
        except QuotaError:
            rows = []
            up.add_metric([], 0)
        for u in rows:
            used.add_metric([u.key, u.kind], u.used)
            capacity.add_metric([u.key, u.kind], u.capacity)
            window.add_metric([u.key, u.kind], u.window_s)
        yield from (used, capacity, window, up)


class QuotaMetrics:
    def __init__(self, service: QuotaService, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reserves = Counter(
            "shoal_quota_reserves",
            "Reserve items by result: allowed, denied (a limit is full) or error.",
            ["result"],
            registry=self.registry,
        )
        self.denials = Counter(
            "shoal_quota_denials",
            "Reserve items not granted, by reason: over_limit, or the item's error code.",
            ["reason"],
            registry=self.registry,
        )
        self.completes = Counter(
            "shoal_quota_completes",
            "Complete items by result: ok, or the item's error code.",
            ["result"],
            registry=self.registry,
        )
        self.registry.register(_Usage(service))

    def observe_reserves(self, results: Sequence[ReserveResult]) -> None:
        for r in results:
            if r.allowed:
                self.reserves.labels(result="allowed").inc()
                continue
            self.reserves.labels(result="error" if r.error else "denied").inc()
            self.denials.labels(reason=_code(r.error) or "over_limit").inc()

    def observe_completes(self, results: Sequence[CompleteResult]) -> None:
        for r in results:
            self.completes.labels(result="ok" if r.ok else _code(r.error)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
