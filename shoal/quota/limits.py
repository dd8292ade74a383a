"""Limits and the service configuration, read from TOML or received over the API.

```toml
lease_ttl_s = 300          # optional: how long a lease is remembered (and the default
                           # timeout of concurrency holds)
[[limit]]
key = "global:llm:openai:gpt-4o:rpm"
kind = "rate"              # rolling window
capacity = 100
window_s = 60

[[limit]]
key = "global:jobs:concurrency"
kind = "concurrency"       # window_s, if given, is how long a hold lives without a Complete
capacity = 8
```
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from shoal.quota.errors import QuotaInvalidError

MAX_AMOUNT = 10**12  # keeps every sum exact in Redis' Lua numbers (doubles)
KEY_PATTERN = re.compile(r"[!-~]{1,200}")  # printable ASCII, no spaces: safe in SQL, Redis and logs


class LimitKind(StrEnum):
    RATE = "rate"
    CONCURRENCY = "concurrency"


@dataclass(frozen=True, slots=True)
class Limit:
    """`window_s`: the rolling window of a rate limit; for a concurrency limit, how long a
    hold lives if its lease is never completed."""

    key: str
    kind: LimitKind
    capacity: int
    window_s: float

    @property
    def window_ms(self) -> int:
        return max(1, round(self.window_s * 1000))

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": str(self.kind),
            "capacity": self.capacity,
            "window_s": self.window_s,
        }


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """`ttl_s`: how long a lease (allowed or denied) is remembered for idempotent replays
    and a late Complete. `concurrency_retry_s`: the longest `retry_after` a full concurrency
    limit advises, since a Complete may free it at any moment."""

    ttl_s: float = 300.0
    concurrency_retry_s: float = 1.0

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def concurrency_retry_ms(self) -> int:
        return max(1, round(self.concurrency_retry_s * 1000))


_DEFAULT_POLICY = LeasePolicy()


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    limits: tuple[Limit, ...] = ()
    policy: LeasePolicy = LeasePolicy()
    max_batch: int = 256
    backend: str | None = None  # a backend URL; None: SQLite in the data dir


def positive_number(d: Mapping[str, Any], name: str, default: float | None = None) -> float:
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise QuotaInvalidError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def positive_int(d: Mapping[str, Any], name: str) -> int | None:
    """`d[name]`, an integer >= 1, or None when absent."""
    value = d.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise QuotaInvalidError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_fields(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise QuotaInvalidError(f"unknown field(s) in {where}: {', '.join(unknown)}")


def parse_limit(d: Any, policy: LeasePolicy) -> Limit:
    """One limit from a TOML table or a JSON object; raises `QuotaInvalidError`."""
    if not isinstance(d, Mapping):
        raise QuotaInvalidError("a limit must be an object")
    check_fields(d, {"key", "kind", "capacity", "window_s"}, "limit")
    key = d.get("key")
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise QuotaInvalidError(f"limit key must be 1-200 printable characters: {key!r}")
    try:
        kind = LimitKind(str(d.get("kind")))
    except ValueError:
        raise QuotaInvalidError(f"limit {key}: kind must be 'rate' or 'concurrency'") from None
    capacity = d.get("capacity")
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise QuotaInvalidError(f"limit {key}: capacity must be an integer")
    if not 1 <= capacity <= MAX_AMOUNT:
        raise QuotaInvalidError(f"limit {key}: capacity must be in 1..{MAX_AMOUNT}")
    if kind is LimitKind.RATE and "window_s" not in d:
        raise QuotaInvalidError(f"limit {key}: a rate limit needs window_s")
    window = positive_number(d, "window_s", policy.ttl_s)
    return Limit(key=key, kind=kind, capacity=capacity, window_s=window)


def parse_config(d: Mapping[str, Any]) -> QuotaConfig:
    check_fields(
        d, {"limit", "lease_ttl_s", "concurrency_retry_s", "max_batch", "backend"}, "config"
    )
    policy = LeasePolicy(
        ttl_s=positive_number(d, "lease_ttl_s", _DEFAULT_POLICY.ttl_s),
        concurrency_retry_s=positive_number(
            d, "concurrency_retry_s", _DEFAULT_POLICY.concurrency_retry_s
        ),
    )
    limits = tuple(parse_limit(x, policy) for x in d.get("limit", []))
    keys = [lim.key for lim in limits]
    if len(set(keys)) != len(keys):
        raise QuotaInvalidError("a limit key is declared twice")
    max_batch = positive_int(d, "max_batch") or 256
    backend = d.get("backend")
    if backend is not None and not isinstance(backend, str):
        raise QuotaInvalidError("backend must be a URL string")
    return QuotaConfig(limits=limits, policy=policy, max_batch=max_batch, backend=backend)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's tables; bad TOML raises `QuotaInvalidError` naming the file."""
    try:
        return tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise QuotaInvalidError(f"{path}: {e}") from e


def load_config(path: str | Path) -> QuotaConfig:
    """Read a limits file; a bad file raises `QuotaInvalidError` naming the problem."""
    return parse_config(read_toml(path))
