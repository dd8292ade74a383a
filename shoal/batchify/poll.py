"""Waiting on providers: growing delays, `Retry-After`, and a poll loop that outlives outages.

A batch can run for a day; one 5xx or 429 in that time must cost a retry, not every caller's
result. Delays grow from `initial_s` to `max_s`, and a `Retry-After` the provider sends wins
whenever it asks for more.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from shoal.batchify.errors import ProviderHTTPError

T = TypeVar("T")


@dataclass(slots=True)
class Backoff:
    initial_s: float
    max_s: float
    factor: float = 1.5
    _next: float = field(init=False)

    def __post_init__(self) -> None:
        self.max_s = max(self.max_s, self.initial_s)
        self._next = self.initial_s

    def next_delay(self, retry_after_s: float | None = None) -> float:
        delay = self._next
        self._next = min(self._next * self.factor, self.max_s)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return delay


@dataclass(slots=True)
class Pacer:
    """Delays between polls of one batch: the backoff's, stretched to the batch's projected
    end once it shows progress, so a long batch costs a handful of polls, not hundreds."""

    backoff: Backoff
    _t0: float | None = None
    _done0: int = 0

    def next_delay(self, done: int, total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        delay = self.backoff.next_delay()
        if self._t0 is None:
            self._t0, self._done0 = now, done
        elif done > self._done0 and now > self._t0 and total > done:
            rate = (done - self._done0) / (now - self._t0)
            delay = max(delay, min((total - done) / rate, self.backoff.max_s))
        return delay


def retry_after_s(headers: dict[str, str] | object, now: float | None = None) -> float | None:
    """Seconds asked by `retry-after-ms` or `Retry-After` (seconds or an HTTP date), if any."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    ms = get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class TransientHTTPError(ProviderHTTPError):
    """Worth retrying: a transport failure, a timeout, a 408/409/429 or a 5xx."""

    def __init__(
        self, message: str, status_code: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, status_code)
        self.retry_after = retry_after


async def with_retries(
    call: Callable[[], Awaitable[T]], backoff: Backoff, attempts: int | None
) -> T:
    """`call()` again after each transient failure (forever when `attempts` is None)."""
    tries = 0
    while True:
        try:
            return await call()
        except TransientHTTPError as e:
            tries += 1
            if attempts is not None and tries >= attempts:
                raise
            await asyncio.sleep(backoff.next_delay(e.retry_after))
