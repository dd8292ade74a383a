"""`/metrics` of the standalone quota server (Prometheus text): reserves by result, denials
by reason, completes, and each limit's usage read from the backend at scrape time."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
from quota_helpers import concurrency, rate, serve

from shoal.quota import QuotaService, new_lease_id
from shoal.quota.http import create_app


def samples(url: str) -> dict[str, float]:
    """Every sample of the scrape, by its name and labels as written."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def item(*reqs: tuple[str, int]) -> dict[str, object]:
    reqs_ = [{"key": k, "amount": a} for k, a in reqs]
    return {"lease_id": new_lease_id(), "requirements": reqs_}


def test_metrics_count_decisions_and_show_usage(
    make_service: Callable[..., QuotaService], backend_kind: str
) -> None:
    service = make_service(backend_kind, [rate("rpm", 2), concurrency("jobs", 1)])
    with serve(create_app(service, api_key="k")) as url:
        held = item(("rpm", 1), ("jobs", 1))
        batch = [held, item(("jobs", 1)), item(("nope", 1)), item(("rpm", 5))]
        r = httpx.post(
            f"{url}/v1/reserve/batch",
            json={"requests": batch},
            headers={"Authorization": "Bearer k"},
        )
        assert [x["allowed"] for x in r.json()["results"]] == [True, False, False, False]
        r = httpx.post(
            f"{url}/v1/complete/batch",
            json={"requests": [{"lease_id": new_lease_id(), "actuals": []}]},
            headers={"Authorization": "Bearer k"},
        )
        assert r.json()["results"][0]["error"] == "lease_not_found"
        got = samples(url)  # open to scrapers without the API key, as the server's is
    assert got['shoal_quota_reserves_total{result="allowed"}'] == 1
    assert got['shoal_quota_reserves_total{result="denied"}'] == 1
    assert got['shoal_quota_reserves_total{result="error"}'] == 2
    assert got['shoal_quota_denials_total{reason="over_limit"}'] == 1
    assert got['shoal_quota_denials_total{reason="unknown_limit_key"}'] == 1
    assert got['shoal_quota_denials_total{reason="exceeds_capacity"}'] == 1
    assert got['shoal_quota_completes_total{result="lease_not_found"}'] == 1
    assert got['shoal_quota_limit_used{key="jobs",kind="concurrency"}'] == 1
    assert got['shoal_quota_limit_used{key="rpm",kind="rate"}'] == 1
    assert got['shoal_quota_limit_capacity{key="rpm",kind="rate"}'] == 2
    assert got['shoal_quota_limit_window_seconds{key="rpm",kind="rate"}'] == 60
    assert got["shoal_quota_backend_up"] == 1
