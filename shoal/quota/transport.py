"""How a client reaches the quota service: in process, or over HTTP with httpx.

Every transport speaks in batches; single calls are batches of one. `QuotaService` itself is
the in-process synchronous transport. HTTP failures (connection refused, timeouts, 5xx,
answers of the wrong shape) raise `QuotaTransportError`, which callers may retry with the
same lease ids; a 400 raises `QuotaInvalidError`, which retrying cannot fix. Closing a
transport closes what it holds (an HTTP connection pool, or the in-process service).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from shoal.quota.errors import QuotaInvalidError, QuotaTransportError
from shoal.quota.limits import LeasePolicy, Limit, parse_limit
from shoal.quota.service import QuotaService
from shoal.quota.types import (
    CompleteRequest,
    CompleteResult,
    ReserveRequest,
    ReserveResult,
    Usage,
)
from shoal.quota.wire import complete_results, reserve_results, to_wire, usage_from_wire


class QuotaAPI(Protocol):
    def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]: ...
    def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]: ...
    def limits(self) -> list[Limit]: ...
    def put_limits(self, limits: Sequence[Limit]) -> list[Limit]: ...
    def usage(self) -> list[Usage]: ...
    def close(self) -> None: ...


class AsyncQuotaAPI(Protocol):
    async def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]: ...
    async def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]: ...
    async def limits(self) -> list[Limit]: ...
    async def put_limits(self, limits: Sequence[Limit]) -> list[Limit]: ...
    async def usage(self) -> list[Usage]: ...
    async def aclose(self) -> None: ...


def _batch(items: Sequence[ReserveRequest] | Sequence[CompleteRequest]) -> dict[str, Any]:
    return {"requests": [to_wire(x) for x in items]}


def _limits_body(limits: Sequence[Limit]) -> dict[str, Any]:
    return {"limits": [lim.to_dict() for lim in limits]}


def _decode(response: httpx.Response) -> Any:
    if response.status_code == 400:
        raise QuotaInvalidError(response.text[:500])
    if response.status_code != 200:
        raise QuotaTransportError(
            f"quota service: HTTP {response.status_code}: {response.text:.200}"
        )
    try:
        return response.json()
    except ValueError as e:
        raise QuotaTransportError("quota service: the answer is not JSON") from e


def _limits(body: Any) -> list[Limit]:
    if not isinstance(body, dict) or not isinstance(body.get("limits"), list):
        raise QuotaTransportError("the quota service sent no limits list")
    return [parse_limit(d, LeasePolicy()) for d in body["limits"]]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class HTTPQuotaAPI:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 10.0):
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return _decode(self._http.request(method, path, json=body))
        except httpx.HTTPError as e:
            raise QuotaTransportError(f"quota service: {e!r}") from e

    def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        return reserve_results(self._call("POST", "/v1/reserve/batch", _batch(items)), len(items))

    def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        body = self._call("POST", "/v1/complete/batch", _batch(items))
        return complete_results(body, len(items))

    def limits(self) -> list[Limit]:
        return _limits(self._call("GET", "/v1/limits"))

    def put_limits(self, limits: Sequence[Limit]) -> list[Limit]:
        return _limits(self._call("PUT", "/v1/limits", _limits_body(limits)))

    def usage(self) -> list[Usage]:
        return usage_from_wire(self._call("GET", "/v1/usage"))

    def close(self) -> None:
        self._http.close()


class AsyncHTTPQuotaAPI:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 10.0):
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, limits=limits
        )

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return _decode(await self._http.request(method, path, json=body))
        except httpx.HTTPError as e:
            raise QuotaTransportError(f"quota service: {e!r}") from e

    async def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        body = await self._call("POST", "/v1/reserve/batch", _batch(items))
        return reserve_results(body, len(items))

    async def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        body = await self._call("POST", "/v1/complete/batch", _batch(items))
        return complete_results(body, len(items))

    async def limits(self) -> list[Limit]:
        return _limits(await self._call("GET", "/v1/limits"))

    async def put_limits(self, limits: Sequence[Limit]) -> list[Limit]:
        return _limits(await self._call("PUT", "/v1/limits", _limits_body(limits)))

    async def usage(self) -> list[Usage]:
        return usage_from_wire(await self._call("GET", "/v1/usage"))

    async def aclose(self) -> None:
        await self._http.aclose()


class LocalAsyncQuotaAPI:
    """An in-process service for asyncio callers: its blocking calls run in worker threads."""

    def __init__(self, service: QuotaService) -> None:
        self.service = service

    async def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        return await asyncio.to_thread(self.service.batch_reserve, items)

    async def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        return await asyncio.to_thread(self.service.batch_complete, items)

    async def limits(self) -> list[Limit]:
        return await asyncio.to_thread(self.service.limits)

    async def put_limits(self, limits: Sequence[Limit]) -> list[Limit]:
        return await asyncio.to_thread(self.service.put_limits, limits)

    async def usage(self) -> list[Usage]:
        return await asyncio.to_thread(self.service.usage)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.service.close)
