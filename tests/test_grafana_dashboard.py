"""The Grafana dashboard (docs/grafana/shoal.json) asks only for what shoal exports.

A live `shoal serve` (tiny model, `--quota` on) is made to export every family the dashboard
reads with samples (a request, a quota denial, a schema refusal, a finished batch line), then
its scrape is merged as a cluster's ingress merges its replicas'. Every panel query's metric
names must be series of that exposition (a counter `x` is `x_total`, a histogram `x_bucket`,
`x_sum`, `x_count`), and the labels it matches on or groups by must be theirs (or those
Prometheus adds when it scrapes: `instance`, `job`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from batch_helpers import chat_line, submit_batch, wait_batch
from prometheus_client.parser import text_string_to_metric_families
from server_harness import LiveServer

from shoal.cluster.metrics import merge
from shoal.cluster.routing import ReplicaCounts

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "shoal.json"
SCRAPE_LABELS = {"instance", "job"}  # Prometheus adds them to every series it scrapes
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created", ""),
    "info": ("_info",),
}
LIMITS = """
[[limit]]
key = "global:jobs:concurrency"
kind = "concurrency"
capacity = 8

[serve]
rpm = 1
tpm = 100000
window_s = 3600
"""


@pytest.fixture(scope="module")
def exported(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, set[str]]:
    """Each series name a server and a cluster export -> the labels its samples carry."""
    limits = tmp_path_factory.mktemp("quota") / "limits.toml"
    limits.write_text(LIMITS)
    live = start_server(quota_config=limits)
    client = live.client(api_key="metered")
    chat = {"model": live.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    client.chat.completions.create(**chat)
    with pytest.raises(openai.RateLimitError):  # rpm = 1: the second is denied
        client.chat.completions.create(**chat)
    strict = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    schema = {"name": "s", "schema": strict, "strict": True}
    with pytest.raises(openai.BadRequestError):  # `not` under strict: a schema refusal
        live.client(api_key="other").chat.completions.create(
            **chat, response_format={"type": "json_schema", "json_schema": schema}
        )
    batch = submit_batch(client, [chat_line("one", live.model, "hi", max_tokens=2)])
    assert wait_batch(client, batch.id).status == "completed"
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    cluster = merge({"0": text}, {"0": ReplicaCounts(hits=1, moved=1, new=1)}).decode()
    series: dict[str, set[str]] = {}
    for exposition in (text, cluster):
        for family in text_string_to_metric_families(exposition):
            for suffix in SUFFIXES.get(family.type, ("",)):
                series.setdefault(family.name + suffix, set())
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


def queries(node: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(panel or variable, PromQL) for every panel target and templating query."""
    if isinstance(node, dict):
        where = str(node.get("title") or node.get("name") or where)
        for key in ("expr", "definition"):
            if isinstance(node.get(key), str):
                yield where, node[key]
        for value in node.values():
            yield from queries(value, where)
    elif isinstance(node, list):
        for value in node:
            yield from queries(value, where)


def test_every_panel_has_a_shoal_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    for panel in panels:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs and all("shoal_" in e for e in exprs), panel["title"]


def test_every_query_names_metrics_and_labels_shoal_exports(
    exported: dict[str, set[str]],
) -> None:
    seen: set[str] = set()
    for where, expr in queries(json.loads(DASHBOARD.read_text())):
        bare = re.sub(r'"[^"]*"', '""', expr)  # label values may look like anything
        names = re.findall(r"\bshoal_\w+", bare)
        assert names, f"{where}: {expr}"
        labels = set(SCRAPE_LABELS)
        for name in names:
            assert name in exported, f"{where}: {name} is not exported"
            labels |= exported[name]
            seen.add(name)
        for name, matchers in re.findall(r"\b(shoal_\w+)\{([^}]*)\}", bare):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in exported[name] | SCRAPE_LABELS, f"{where}: {name} has no {label}"
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", bare):
            for label in re.findall(r"\w+", grouping):
                assert label in labels, f"{where}: no series here has a {label} label"
        for label in re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", bare):
            assert label in labels, f"{where}: {label}"
    # The panels the dashboard exists for.
    for family in (
        "shoal_generation_tokens_total",
        "shoal_time_to_first_token_seconds_bucket",
        "shoal_inter_token_latency_seconds_bucket",
        "shoal_num_requests_running",
        "shoal_num_requests_waiting",
        "shoal_kv_cache_usage_ratio",
        "shoal_session_hits_total",
        "shoal_kv_host_hits_total",
        "shoal_cluster_session_hit_rate",
        "shoal_batch_requests_total",
        "shoal_quota_denials_total",
    ):
        assert family in seen, family
