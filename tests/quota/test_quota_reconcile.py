"""Time: rolling windows, refunds and debt, expiry of holds and leases, a clock moved back.

SQLite runs on a hand-moved clock, so these are exact. Redis uses its server's `TIME` (as it
must: no client clock), so its half uses short windows and real waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from quota_helpers import complete, concurrency, rate, reserve, used

from shoal.quota import LeasePolicy, QuotaService
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.testing import ManualClock

Make = Callable[..., QuotaService]
S = 1000  # ms


@pytest.fixture
def svc(make_service: Make) -> QuotaService:
    limits = [rate("rpm", 3, 60), rate("tpm", 1000, 60), concurrency("jobs", 1, 30)]
    return make_service("sqlite", limits)


def test_the_window_rolls(svc: QuotaService, clock: ManualClock) -> None:
    for _ in range(3):
        assert svc.reserve(reserve(("rpm", 1))).allowed
        clock.advance(10 * S)
    denied = svc.reserve(reserve(("rpm", 1)))  # at t=30 s; the first expires at t=60 s
    assert not denied.allowed and denied.retry_after_ms == 30 * S
    clock.advance(30 * S - 1)
    assert svc.reserve(reserve(("rpm", 1))).retry_after_ms == 1
    clock.advance(1)  # exactly when retry_after said
    assert svc.reserve(reserve(("rpm", 1))).allowed
    assert not svc.reserve(reserve(("rpm", 1))).allowed  # the one from t=10 s is still live


def test_a_smaller_actual_is_refunded(svc: QuotaService, clock: ManualClock) -> None:
    item = reserve(("tpm", 800), ("rpm", 1))
    assert svc.reserve(item).allowed
    assert not svc.reserve(reserve(("tpm", 300))).allowed
    assert svc.complete(complete(item.lease_id, ("tpm", 100))).ok
    assert used(svc) == {"jobs": 0, "rpm": 1, "tpm": 100}
    assert svc.reserve(reserve(("tpm", 900))).allowed
    clock.advance(60 * S)
    assert used(svc) == {"jobs": 0, "rpm": 0, "tpm": 0}


def test_a_larger_actual_is_debt_that_delays_later_reservations(
    svc: QuotaService, clock: ManualClock
) -> None:
    item = reserve(("tpm", 500))
    assert svc.reserve(item).allowed
    clock.advance(20 * S)
    assert svc.complete(complete(item.lease_id, ("tpm", 1500))).ok
    assert used(svc)["tpm"] == 1500  # over capacity: debt
    # 501 must free: the reserved 500 expires at 60 s, the 1000 of debt at 20 + 60 = 80 s.
    denied = svc.reserve(reserve(("tpm", 1)))
    assert not denied.allowed and denied.retry_after_ms == 60 * S
    clock.advance(40 * S)
    assert used(svc)["tpm"] == 1000
    assert svc.reserve(reserve(("tpm", 1))).retry_after_ms == 20 * S
    clock.advance(20 * S)
    assert svc.reserve(reserve(("tpm", 1000))).allowed


def test_an_unreserved_key_can_be_charged_at_completion(svc: QuotaService) -> None:
    item = reserve(("rpm", 1))
    assert svc.reserve(item).allowed
    assert svc.complete(complete(item.lease_id, ("tpm", 700))).ok
    assert used(svc)["tpm"] == 700


def test_concurrency_is_released_by_complete_or_by_timeout(
    svc: QuotaService, clock: ManualClock
) -> None:
    first = reserve(("jobs", 1))
    assert svc.reserve(first).allowed
    assert svc.complete(complete(first.lease_id)).ok
    forgotten = reserve(("jobs", 1))
    assert svc.reserve(forgotten).allowed  # never completed
    denied = svc.reserve(reserve(("jobs", 1)))
    assert not denied.allowed and denied.retry_after_ms == 1000  # the polling hint, not 30 s
    clock.advance(30 * S)
    assert svc.reserve(reserve(("jobs", 1))).allowed
    # The forgotten lease may still complete (nothing left to release) until the lease TTL.
    assert svc.complete(complete(forgotten.lease_id)).ok
    assert used(svc)["jobs"] == 1


def test_a_lease_is_forgotten_after_its_ttl(svc: QuotaService, clock: ManualClock) -> None:
    item = reserve(("rpm", 1))
    assert svc.reserve(item).allowed
    clock.advance(300 * S)  # the default lease TTL, beyond the 60 s window
    assert svc.complete(complete(item.lease_id)).error == "lease_not_found"
    assert svc.reserve(item).allowed  # the id is free again: a fresh first attempt


def test_retry_after_of_concurrency_is_the_expiry_when_sooner_than_the_hint(
    make_service: Make, clock: ManualClock
) -> None:
    svc = make_service("sqlite", [concurrency("jobs", 1, 0.25)], LeasePolicy(ttl_s=60))
    assert svc.reserve(reserve(("jobs", 1))).allowed
    assert svc.reserve(reserve(("jobs", 1))).retry_after_ms == 250


def test_a_clock_moved_back_frees_nothing_early_even_across_a_restart(
    tmp_path: Path, clock: ManualClock
) -> None:
    db = tmp_path / "q.db"
    svc = QuotaService(SQLiteBackend(db, clock=clock))
    svc.put_limits([rate("rpm", 1, 60)])
    assert svc.reserve(reserve(("rpm", 1))).allowed
    clock.advance(-3600 * S)  # an NTP step back by an hour
    assert not svc.reserve(reserve(("rpm", 1))).allowed
    svc.close()
    clock.advance(61 * S)  # still an hour behind the time already stored
    svc = QuotaService(SQLiteBackend(db, clock=clock))
    denied = svc.reserve(reserve(("rpm", 1)))
    assert not denied.allowed and denied.retry_after_ms == 60 * S
    clock.advance(3600 * S)
    assert svc.reserve(reserve(("rpm", 1))).allowed
    svc.close()


# -- Redis, on its own clock -----------------------------------------------------------


# Redis's clock cannot be set: its windows are real time, long beside a loaded machine's
# round trips (a few milliseconds) so that the denial always lands inside them.
REDIS_WINDOW_S = 2.0


def test_redis_window_rolls_on_the_server_clock(make_service: Make) -> None:
    svc = make_service("redis", [rate("rpm", 2, REDIS_WINDOW_S)])
    assert all(r.allowed for r in svc.batch_reserve([reserve(("rpm", 1)) for _ in range(2)]))
    denied = svc.reserve(reserve(("rpm", 1)))
    assert not denied.allowed and 0 < denied.retry_after_ms <= REDIS_WINDOW_S * S
    time.sleep(denied.retry_after_ms / 1000 + 0.01)
    assert svc.reserve(reserve(("rpm", 1))).allowed


def test_redis_refund_and_debt(make_service: Make) -> None:
    svc = make_service("redis", [rate("tpm", 1000, 60)])
    small, big = reserve(("tpm", 400)), reserve(("tpm", 400))
    assert all(r.allowed for r in svc.batch_reserve([small, big]))
    results = svc.batch_complete(
        [complete(small.lease_id, ("tpm", 50)), complete(big.lease_id, ("tpm", 1200))]
    )
    assert all(r.ok for r in results)
    assert used(svc)["tpm"] == 1250
    denied = svc.reserve(reserve(("tpm", 1)))
    assert not denied.allowed and 59 * S < denied.retry_after_ms <= 60 * S


def test_redis_concurrency_hold_times_out(make_service: Make) -> None:
    svc = make_service("redis", [concurrency("jobs", 1, REDIS_WINDOW_S)], LeasePolicy(ttl_s=60))
    assert svc.reserve(reserve(("jobs", 1))).allowed
    denied = svc.reserve(reserve(("jobs", 1)))
    assert not denied.allowed and 0 < denied.retry_after_ms <= REDIS_WINDOW_S * S
    time.sleep(REDIS_WINDOW_S + 0.05)  # the hold's whole timeout (the retry hint may be less)
    assert svc.reserve(reserve(("jobs", 1))).allowed
