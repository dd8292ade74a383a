"""What a quota store does, and how a URL picks one.

Backends receive items the service has already validated (ULID lease ids, 1..32 requirements,
amounts in range, no repeated key), so they only decide. Within one item every requirement is
taken or none is; items of a batch are decided one after another, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from shoal.quota.clock import Clock
from shoal.quota.errors import QuotaInvalidError
from shoal.quota.limits import LeasePolicy, Limit
from shoal.quota.types import (
    CompleteRequest,
    CompleteResult,
    ReserveRequest,
    ReserveResult,
    Usage,
)


class QuotaBackend(Protocol):
    name: str
    policy: LeasePolicy

    def reserve_many(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]: ...

    def complete_many(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]: ...

    def put_limits(self, limits: Sequence[Limit]) -> None:
        """Add or change limits, all or none; a key's kind cannot change (`QuotaInvalidError`)."""
        ...

    def usage(self) -> list[Usage]: ...

    def close(self) -> None: ...


def open_backend(
    url: str | None,
    *,
    data_dir: str | Path = "./shoal-data",
    policy: LeasePolicy | None = None,
    clock: Clock | None = None,
) -> QuotaBackend:
    """`None` (SQLite file `quota.db` in `data_dir`), `sqlite:///relative.db`,
    `sqlite:////absolute.db` or `redis://host:port/db` (also `rediss://`, `unix://`)."""
    policy = policy or LeasePolicy()
    if url is None or url.startswith("sqlite:///"):
        from shoal.quota.sqlite_backend import SQLiteBackend

        if url is None:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            path = Path(data_dir) / "quota.db"
        else:
            path = Path(url.removeprefix("sqlite:///"))
        return SQLiteBackend(path, policy=policy, clock=clock)
    if url.startswith(("redis://", "rediss://", "unix://")):
        if clock is not None:
            raise QuotaInvalidError("the Redis backend uses the Redis server's clock")
        from shoal.quota.redis_backend import RedisBackend

        return RedisBackend.from_url(url, policy=policy)
    raise QuotaInvalidError(f"unknown backend URL {url!r} (sqlite:///... or redis://...)")
