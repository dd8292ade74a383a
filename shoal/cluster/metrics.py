"""The ingress's `/metrics`: every replica's own metrics (the same families as `shoal serve`'s),
each sample labelled with its `replica`, and the router's session placement per replica."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from shoal.cluster.routing import ReplicaCounts


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge(replica_texts: dict[str, str], routing: dict[str, ReplicaCounts]) -> bytes:
    """One exposition: the replicas' families merged (a `replica` label on each sample) and
    the session placement counts."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(replica_texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples += [
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
    requests = CounterMetricFamily(
        "shoal_cluster_session_requests",
        "Session requests by the replica that answered: hit (where the session's previous "
        "request went), moved (elsewhere: its home was overloaded or gone), new.",
        labels=["replica", "placement"],
    )
    hit_rate = GaugeMetricFamily(
        "shoal_cluster_session_hit_rate",
        "Of a replica's session requests after a session's first, the share that found the "
        "session where its previous request went.",
        labels=["replica"],
    )
    for replica, c in sorted(routing.items()):
        for placement, n in (("hit", c.hits), ("moved", c.moved), ("new", c.new)):
            requests.add_metric([replica, placement], n)
        hit_rate.add_metric([replica], c.hit_rate)
    registry = CollectorRegistry()
    registry.register(_Merged([*families.values(), requests, hit_rate]))
    return generate_latest(registry)
