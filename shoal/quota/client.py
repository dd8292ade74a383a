"""`QuotaClient` (blocking) and `AsyncQuotaClient`: the quota service in process or over HTTP.

Both have `reserve`, `complete`, `batch_reserve`, `batch_complete`, `limits`, `put_limits`,
`usage`, and `lease(requirements)`, a context manager that reserves (waiting out denials up to
`max_wait_s`, each attempt under a new lease id, since a denied lease stays denied), hands back
a `Lease` to report actual amounts on, and completes it on exit, even when the body raised.
The async client sends single calls through a `Batcher` unless told not to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from shoal.quota.batcher import Batcher
from shoal.quota.errors import (
    ItemError,
    QuotaError,
    QuotaExceededError,
    QuotaItemError,
    QuotaTransportError,
)
from shoal.quota.limits import Limit
from shoal.quota.service import QuotaService
from shoal.quota.transport import (
    AsyncHTTPQuotaAPI,
    AsyncQuotaAPI,
    HTTPQuotaAPI,
    LocalAsyncQuotaAPI,
    QuotaAPI,
)
from shoal.quota.types import (
    Actual,
    CompleteRequest,
    CompleteResult,
    Requirement,
    ReserveRequest,
    ReserveResult,
    Usage,
    new_lease_id,
)

log = logging.getLogger("shoal.quota")
_COMPLETE_TRIES = 3


@dataclass(slots=True)
class Lease:
    """A granted reservation. Report what was really used with `report`; rate keys left
    unreported are charged as reserved."""

    lease_id: str
    job_id: str
    requirements: tuple[Requirement, ...]
    reserved_at_unix_ms: int
    actuals: dict[str, int] = field(default_factory=dict)

    def report(self, key: str, actual_amount: int) -> None:
        self.actuals[key] = actual_amount

    def complete_request(self) -> CompleteRequest:
        actuals = tuple(Actual(k, v) for k, v in self.actuals.items())
        return CompleteRequest(self.lease_id, actuals, self.job_id)


class _Attempts:
    """The reserve loop both clients run, minus the waiting: what to do after each answer."""

    def __init__(self, requirements: Sequence[Requirement], job_id: str, max_wait_s: float):
        self.request = ReserveRequest(new_lease_id(), tuple(requirements), job_id)
        self.deadline = time.monotonic() + max_wait_s
        self.failures = 0

    def next(self, outcome: ReserveResult | QuotaTransportError) -> Lease | float:
        """The lease once granted; else seconds to wait before trying `self.request` again.
        Raises when the wait would overrun the deadline or the service refused for good."""
        if isinstance(outcome, QuotaTransportError) or outcome.error == ItemError.BACKEND_ERROR:
            # Same lease id: the failed attempt may have been applied, and a replay is free.
            self.failures += 1
            delay = min(1.0, 0.05 * 2**self.failures)
            if time.monotonic() + delay > self.deadline:
                if isinstance(outcome, QuotaTransportError):
                    raise outcome
                raise QuotaTransportError("the quota backend kept failing")
            return delay
        if outcome.allowed:
            req = self.request
            return Lease(
                req.lease_id, req.job_id, tuple(req.requirements), outcome.reserved_at_unix_ms
            )
        if outcome.error:
            raise QuotaItemError(outcome.error)
        delay = outcome.retry_after_ms / 1000
        if time.monotonic() + delay > self.deadline:
            raise QuotaExceededError("quota still exhausted at the end of the wait", delay)
        self.request = ReserveRequest(
            new_lease_id(), self.request.requirements, self.request.job_id
        )
        return delay


def _complete_step(outcome: CompleteResult | QuotaTransportError, attempt: int) -> float | None:
    """None once the lease is completed, else seconds before trying again; raises when the
    service refused for good or after the last try. A retried Complete that finds its first
    attempt applied (`already_completed`) has succeeded too."""
    if isinstance(outcome, CompleteResult):
        if outcome.ok or outcome.error == ItemError.ALREADY_COMPLETED:
            return None
        if outcome.error != ItemError.BACKEND_ERROR:
            raise QuotaItemError(outcome.error)
    if attempt + 1 >= _COMPLETE_TRIES:
        if isinstance(outcome, QuotaTransportError):
            raise outcome
        raise QuotaTransportError("the quota backend kept failing to complete the lease")
    return 0.05 * 2**attempt


def _one(results: list[ReserveResult] | list[CompleteResult]) -> None:
    if len(results) != 1:
        raise QuotaTransportError(f"{len(results)} results for one item")


class QuotaClient:
    """Blocking client; it owns (and closes) its transport."""

    def __init__(self, api: QuotaAPI, *, max_wait_s: float = 30.0) -> None:
        self.api = api
        self.max_wait_s = max_wait_s

    @classmethod
    def http(
        cls,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        max_wait_s: float = 30.0,
    ) -> QuotaClient:
        return cls(HTTPQuotaAPI(base_url, api_key=api_key, timeout=timeout), max_wait_s=max_wait_s)

    def reserve(self, item: ReserveRequest) -> ReserveResult:
        results = self.api.batch_reserve([item])
        _one(results)
        return results[0]

    def complete(self, item: CompleteRequest) -> CompleteResult:
        results = self.api.batch_complete([item])
        _one(results)
        return results[0]

    def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        return self.api.batch_reserve(items)

    def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        return self.api.batch_complete(items)

    def limits(self) -> list[Limit]:
        return self.api.limits()

    def put_limits(self, limits: Sequence[Limit]) -> list[Limit]:
        return self.api.put_limits(limits)

    def usage(self) -> list[Usage]:
        return self.api.usage()

    @contextmanager
    def lease(
        self,
        requirements: Sequence[Requirement],
        *,
        job_id: str = "",
        max_wait_s: float | None = None,
    ) -> Iterator[Lease]:
        attempts = _Attempts(
            requirements, job_id, self.max_wait_s if max_wait_s is None else max_wait_s
        )
        while True:
            outcome: ReserveResult | QuotaTransportError
            try:
                outcome = self.reserve(attempts.request)
            except QuotaTransportError as e:
                outcome = e
            step = attempts.next(outcome)
            if isinstance(step, Lease):
                break
            time.sleep(step)
        try:
            yield step
        except BaseException:
            self._finish(step, quiet=True)
            raise
        self._finish(step, quiet=False)

    def _finish(self, lease: Lease, *, quiet: bool) -> None:
        try:
            for attempt in itertools.count():
                outcome: CompleteResult | QuotaTransportError
                try:
                    outcome = self.complete(lease.complete_request())
                except QuotaTransportError as e:
                    outcome = e
                delay = _complete_step(outcome, attempt)
                if delay is None:
                    return
                time.sleep(delay)
        except QuotaError:
            if not quiet:
                raise
            log.warning("lease %s not completed; it expires on its own", lease.lease_id)

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> QuotaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncQuotaClient:
    """Asyncio client; single calls go through a `Batcher` (`batching=False`: one call each)."""

    def __init__(
        self,
        api: AsyncQuotaAPI,
        *,
        batching: bool = True,
        max_batch: int = 256,
        flush_interval_s: float = 0.002,
        max_wait_s: float = 30.0,
    ) -> None:
        self.api = api
        self.max_wait_s = max_wait_s
        self.batcher = (
            Batcher(api, max_batch=max_batch, flush_interval_s=flush_interval_s)
            if batching
            else None
        )

    @classmethod
    def http(
        cls, base_url: str, *, api_key: str | None = None, timeout: float = 10.0, **kw: Any
    ) -> AsyncQuotaClient:
        return cls(AsyncHTTPQuotaAPI(base_url, api_key=api_key, timeout=timeout), **kw)

    @classmethod
    def local(cls, service: QuotaService, **kw: Any) -> AsyncQuotaClient:
        return cls(LocalAsyncQuotaAPI(service), **kw)

    async def reserve(self, item: ReserveRequest) -> ReserveResult:
        if self.batcher is not None:
            return await self.batcher.reserve(item)
        results = await self.api.batch_reserve([item])
        _one(results)
        return results[0]

    async def complete(self, item: CompleteRequest) -> CompleteResult:
        if self.batcher is not None:
            return await self.batcher.complete(item)
        results = await self.api.batch_complete([item])
        _one(results)
        return results[0]

    async def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        return await self.api.batch_reserve(items)

    async def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        return await self.api.batch_complete(items)

    async def limits(self) -> list[Limit]:
        return await self.api.limits()

    async def put_limits(self, limits: Sequence[Limit]) -> list[Limit]:
        return await self.api.put_limits(limits)

    async def usage(self) -> list[Usage]:
        return await self.api.usage()

    @asynccontextmanager
    async def lease(
        self,
        requirements: Sequence[Requirement],
        *,
        job_id: str = "",
        max_wait_s: float | None = None,
    ) -> AsyncIterator[Lease]:
        attempts = _Attempts(
            requirements, job_id, self.max_wait_s if max_wait_s is None else max_wait_s
        )
        while True:
            outcome: ReserveResult | QuotaTransportError
            try:
                outcome = await self.reserve(attempts.request)
            except QuotaTransportError as e:
                outcome = e
            step = attempts.next(outcome)
            if isinstance(step, Lease):
                break
            await asyncio.sleep(step)
        try:
            yield step
        except BaseException:
            await self._finish(step, quiet=True)
            raise
        await self._finish(step, quiet=False)

    async def _finish(self, lease: Lease, *, quiet: bool) -> None:
        try:
            for attempt in itertools.count():
                outcome: CompleteResult | QuotaTransportError
                try:
                    outcome = await self.complete(lease.complete_request())
                except QuotaTransportError as e:
                    outcome = e
                delay = _complete_step(outcome, attempt)
                if delay is None:
                    return
                await asyncio.sleep(delay)
        except QuotaError:
            if not quiet:
                raise
            log.warning("lease %s not completed; it expires on its own", lease.lease_id)

    async def aclose(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        await self.api.aclose()

    async def __aenter__(self) -> AsyncQuotaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
