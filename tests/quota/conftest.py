"""Quota fixtures: services on SQLite (with a hand-moved clock) and on a real Redis server.

One `redis-server` (Debian's package; `make test` installs it) runs for the session on a free
loopback port in a temporary folder; each test gets its own key prefix, so tests never see
each other's limits. Set SHOAL_SKIP_REDIS_TESTS=1 to skip the Redis half where the binary
cannot be installed; without it a missing binary fails the tests.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ulid import ULID

from shoal.quota import Limit, QuotaService
from shoal.quota.limits import LeasePolicy
from shoal.quota.redis_backend import RedisBackend
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.testing import LocalRedis, ManualClock, local_redis


def redis_available() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("SHOAL_SKIP_REDIS_TESTS") == "1":
            pytest.skip("redis-server is not installed and SHOAL_SKIP_REDIS_TESTS=1")
        pytest.fail("redis-server is not installed: run `make test`, which installs it")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    redis_available()
    with local_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_service(
    request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock
) -> Iterator[Callable[..., QuotaService]]:
    """`make_service(kind, limits, policy=None)`: a fresh service; SQLite runs on `clock`,
    Redis on its server's own clock under a prefix of its own."""
    made: list[QuotaService] = []

    def make(kind: str, limits: list[Limit], policy: LeasePolicy | None = None) -> QuotaService:
        if kind == "sqlite":
            db = tmp_path / f"quota-{len(made)}.db"
            backend: SQLiteBackend | RedisBackend = SQLiteBackend(db, policy=policy, clock=clock)
        else:
            server = request.getfixturevalue("redis_server")
            backend = RedisBackend(server.client(), policy=policy, prefix=f"t:{ULID()}")
        service = QuotaService(backend)
        service.put_limits(limits)
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()


@pytest.fixture(params=["sqlite", "redis"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind
