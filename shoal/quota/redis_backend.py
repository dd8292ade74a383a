"""The shared backend: Redis, for limiter processes on several machines.

All the deciding happens in `quota.lua`, one script call per batch, so the Redis server's
clock (`TIME`) is the only clock and no two limiters can interleave inside an item. redis-py
runs the script by its SHA and loads it again when the server has lost it (`NOSCRIPT`).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

from shoal.quota.errors import QuotaBackendError, QuotaInvalidError
from shoal.quota.limits import LeasePolicy, Limit
from shoal.quota.types import (
    CompleteRequest,
    CompleteResult,
    ReserveRequest,
    ReserveResult,
    Usage,
    fingerprint,
)
from shoal.urls import redact

_SCRIPT = resources.files("shoal.quota").joinpath("quota.lua").read_text()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisBackend:
    name = "redis"

    def __init__(
        self,
        client: redis.Redis,
        *,
        policy: LeasePolicy | None = None,
        prefix: str = "shoal:quota",
    ) -> None:
        self.policy = policy or LeasePolicy()
        self.prefix = prefix
        self._client = client
        self._script = client.register_script(_SCRIPT)

    @classmethod
    def from_url(cls, url: str, *, connect_timeout_s: float = 5.0, **kw: Any) -> RedisBackend:
        """A backend on the server at `url`, which must answer now (`QuotaBackendError`
        otherwise: a wrong URL shows at start-up, not at the first reserve)."""
        client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s)
        try:
            client.ping()
        except redis.RedisError as e:
            client.close()
            raise QuotaBackendError(f"cannot reach the quota backend {redact(url)}: {e}") from e
        return cls(client, **kw)

    def _run(self, op: str, *args: str | int) -> Any:
        try:
            return self._script(args=[self.prefix, op, *args])
        except redis.RedisError as e:
            raise QuotaBackendError(f"redis: {e}") from e

    def reserve_many(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        args: list[str | int] = [self.policy.ttl_ms, self.policy.concurrency_retry_ms, len(items)]
        for item in items:
            args += [item.lease_id, fingerprint(item), len(item.requirements)]
            for r in item.requirements:
                args += [r.key, r.amount]
        return [
            ReserveResult(bool(ok), int(retry), int(at), _text(err))
            for ok, retry, at, err in self._run("reserve", *args)
        ]

    def complete_many(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        args: list[str | int] = [len(items)]
        for item in items:
            args += [item.lease_id, len(item.actuals)]
            for a in item.actuals:
                args += [a.key, a.actual_amount]
        return [CompleteResult(bool(ok), _text(err)) for ok, err in self._run("complete", *args)]

    def put_limits(self, limits: Sequence[Limit]) -> None:
        args: list[str | int] = [len(limits)]
        for lim in limits:
            args += [lim.key, str(lim.kind), lim.capacity, lim.window_ms]
        conflict = _text(self._run("put_limits", *args))
        if conflict:
            raise QuotaInvalidError(f"limit {conflict} exists with another kind")

    def usage(self) -> list[Usage]:
        rows = [
            Usage(_text(k), _text(kind), int(cap), int(win) / 1000, int(used))
            for k, kind, cap, win, used in self._run("usage")
        ]
        return sorted(rows, key=lambda u: u.key)

    def close(self) -> None:
        self._client.close()
