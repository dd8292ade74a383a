"""State survives a restart: of the limiter (a new process on the same SQLite file or Redis),
and of the Redis server itself (its append-only file)."""

from __future__ import annotations

from pathlib import Path

from quota_helpers import complete, concurrency, rate, reserve, used

from shoal.quota import QuotaService
from shoal.quota.redis_backend import RedisBackend
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.testing import ManualClock, local_redis

LIMITS = [rate("rpm", 2, 60), concurrency("jobs", 1, 300)]


def _before(service: QuotaService) -> tuple[str, str]:
    """Fill both limits; returns the holding lease and a denied one."""
    service.put_limits(LIMITS)
    holder = reserve(("rpm", 1), ("jobs", 1))
    denied = reserve(("rpm", 1), ("jobs", 1))
    results = service.batch_reserve([holder, denied])
    assert [r.allowed for r in results] == [True, False]
    return holder.lease_id, denied.lease_id


def _after(service: QuotaService, holder: str, denied: str) -> None:
    assert used(service) == {"jobs": 1, "rpm": 1}
    assert service.reserve(reserve(("rpm", 1), ("jobs", 1), lease_id=holder)).allowed  # replay
    assert not service.reserve(reserve(("rpm", 1), ("jobs", 1), lease_id=denied)).allowed
    assert used(service) == {"jobs": 1, "rpm": 1}
    assert service.complete(complete(holder)).ok
    assert service.complete(complete(holder)).error == "already_completed"
    assert used(service) == {"jobs": 0, "rpm": 1}
    assert not service.reserve(reserve(("rpm", 2))).allowed  # the window still counts 1


def test_sqlite_state_survives_a_restart(tmp_path: Path, clock: ManualClock) -> None:
    db = tmp_path / "quota.db"
    first = QuotaService(SQLiteBackend(db, clock=clock))
    holder, denied = _before(first)
    first.close()
    clock.advance(5000)
    second = QuotaService(SQLiteBackend(db, clock=clock))
    try:
        _after(second, holder, denied)
    finally:
        second.close()


def test_redis_state_survives_a_new_limiter_and_a_server_restart(tmp_path: Path) -> None:
    with local_redis(tmp_path) as server:
        first = QuotaService(RedisBackend(server.client(), prefix="q"))
        holder, denied = _before(first)
        first.close()
        server.restart()
        second = QuotaService(RedisBackend(server.client(), prefix="q"))
        try:
            _after(second, holder, denied)
        finally:
            second.close()


def test_two_sqlite_limiters_share_one_file(tmp_path: Path, clock: ManualClock) -> None:
    db = tmp_path / "shared.db"
    a = QuotaService(SQLiteBackend(db, clock=clock))
    b = QuotaService(SQLiteBackend(db, clock=clock))
    try:
        a.put_limits(LIMITS)
        item = reserve(("jobs", 1))
        assert a.reserve(item).allowed
        assert not b.reserve(reserve(("jobs", 1))).allowed
        assert b.complete(complete(item.lease_id)).ok  # completed through the other one
        assert a.reserve(reserve(("jobs", 1))).allowed
    finally:
        a.close()
        b.close()
