"""The HTTP contract of design input 004, against a live uvicorn server on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from quota_helpers import concurrency, rate, serve

from shoal.quota import QuotaService, new_lease_id
from shoal.quota.http import create_app

Make = Callable[..., QuotaService]


@pytest.fixture
def service(make_service: Make, backend_kind: str) -> QuotaService:
    return make_service(backend_kind, [rate("rpm", 2), rate("tpm", 1000), concurrency("jobs", 1)])


@pytest.fixture
def http(service: QuotaService) -> Iterator[httpx.Client]:
    with serve(create_app(service)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


def item(*reqs: tuple[str, int], lease_id: str | None = None) -> dict[str, Any]:
    return {
        "lease_id": lease_id or new_lease_id(),
        "job_id": "01J-job",
        "requirements": [{"key": k, "amount": a} for k, a in reqs],
    }


def usage(http: httpx.Client) -> dict[str, int]:
    return {u["key"]: u["used"] for u in http.get("/v1/usage").json()["usage"]}


def test_reserve_and_complete_batches_answer_in_order(http: httpx.Client) -> None:
    held = item(("rpm", 1), ("jobs", 1))
    r = http.post(
        "/v1/reserve/batch",
        json={
            "requests": [
                held,
                item(("rpm", 1), ("jobs", 1)),  # jobs is full: denied
                {"lease_id": new_lease_id(), "requirements": [{"key": "rpm", "amount": "1"}]},
                {**item(("rpm", 1)), "priority": 5},  # an unknown field in an item
                "not an object",
                item(("nope", 1)),
                item(("tpm", 100)),
            ]
        },
    )
    assert r.status_code == 200
    results = r.json()["results"]
    assert set(results[0]) == {"allowed", "retry_after_ms", "reserved_at_unix_ms", "error"}
    assert [(x["allowed"], x["error"]) for x in results] == [
        (True, ""),
        (False, ""),
        (False, "invalid_request"),
        (False, "invalid_request"),
        (False, "invalid_request"),
        (False, "unknown_limit_key:nope"),
        (True, ""),
    ]
    assert results[1]["retry_after_ms"] > 0
    r = http.post(
        "/v1/complete/batch",
        json={
            "requests": [
                {
                    "lease_id": held["lease_id"],
                    "job_id": "01J-job",
                    "actuals": [{"key": "rpm", "actual_amount": 0}],
                },
                {"lease_id": held["lease_id"]},
                {"lease_id": new_lease_id()},
                {"lease_id": held["lease_id"], "actuals": [{"key": "rpm"}]},
            ]
        },
    )
    assert r.status_code == 200
    assert r.json() == {
        "results": [
            {"ok": True, "error": ""},
            {"ok": False, "error": "already_completed"},
            {"ok": False, "error": "lease_not_found"},
            {"ok": False, "error": "invalid_request"},
        ]
    }
    assert usage(http) == {"jobs": 0, "rpm": 0, "tpm": 100}


MALFORMED: list[Any] = [
    {"requests": []},
    {"requests": [item(("rpm", 1)) for _ in range(257)]},
    {"requests": [item(("rpm", 1))], "mode": "atomic"},  # unknown top-level field
    {"requests": {"lease_id": new_lease_id()}},
    {},
    "{not json",
]


def test_a_malformed_batch_is_400_and_changes_nothing(http: httpx.Client) -> None:
    for body in MALFORMED:
        for path in ("/v1/reserve/batch", "/v1/complete/batch"):
            if isinstance(body, str):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
    assert usage(http) == {"jobs": 0, "rpm": 0, "tpm": 0}


def test_single_reserve_and_complete(http: httpx.Client) -> None:
    one = item(("jobs", 1))
    r = http.post("/v1/reserve", json=one)
    assert r.status_code == 200 and r.json()["allowed"] is True
    assert http.post("/v1/reserve", json=one).json() == r.json()  # replay
    bad = http.post("/v1/reserve", json={"lease_id": "x", "requirements": []}).json()
    assert bad == {
        "allowed": False,
        "retry_after_ms": 0,
        "reserved_at_unix_ms": 0,
        "error": "invalid_request",
    }
    assert http.post("/v1/complete", json={"lease_id": one["lease_id"]}).json() == {
        "ok": True,
        "error": "",
    }


def test_limits_can_be_read_and_declared(http: httpx.Client) -> None:
    limits = http.get("/v1/limits").json()["limits"]
    assert {"key": "rpm", "kind": "rate", "capacity": 2, "window_s": 60.0} in limits
    new = {"key": "global:llm:openai:gpt-4o:tpm", "kind": "rate", "capacity": 5, "window_s": 60}
    r = http.put(
        "/v1/limits",
        json={"limits": [new, {"key": "rpm", "kind": "rate", "capacity": 10, "window_s": 60}]},
    )
    assert r.status_code == 200
    keys = {lim["key"]: lim["capacity"] for lim in r.json()["limits"]}
    assert keys["global:llm:openai:gpt-4o:tpm"] == 5 and keys["rpm"] == 10
    clash = {"key": "rpm", "kind": "concurrency", "capacity": 1}
    r = http.put("/v1/limits", json={"limits": [clash]})
    assert r.status_code == 400 and "rpm" in r.json()["error"]["message"]
    r = http.put("/v1/limits", json={"limits": [{"key": "x", "kind": "rate", "capacity": 0}]})
    assert r.status_code == 400
    assert http.get("/health").json()["status"] == "ok"


def test_an_api_key_guards_everything_but_health(service: QuotaService) -> None:
    with serve(create_app(service, api_key="s3cret")) as url:
        assert httpx.get(f"{url}/v1/limits").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        ok = httpx.get(f"{url}/v1/limits", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
