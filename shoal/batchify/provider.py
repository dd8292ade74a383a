"""The batcher's own HTTP calls to providers (uploads, batch create, polls, result files).

They go through `httpx` like the SDKs' calls, so each carries a request extension that the
interception hook lets through (a header would reach the provider). Every call is counted:
the benchmark compares these counts with the requests a direct run sends.
"""

from __future__ import annotations

from typing import Any

import httpx

from shoal.batchify.calls import Target
from shoal.batchify.errors import ProviderHTTPError
from shoal.batchify.poll import TransientHTTPError, retry_after_s

INTERNAL = "shoal_batchify_internal"
_RETRY_STATUS = frozenset({408, 409, 429})


class ProviderHTTP:
    def __init__(self, timeout_s: float = 120.0, transport: httpx.AsyncBaseTransport | None = None):
        self._client = httpx.AsyncClient(
            timeout=timeout_s, transport=transport, follow_redirects=True
        )
        self.requests_sent = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(
        self,
        method: str,
        target: Target,
        path: str,
        *,
        json: Any = None,
        files: Any = None,
        data: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One call under `target`'s credentials; raises TransientHTTPError or
        ProviderHTTPError instead of returning an error status."""
        url = target.base_url.rstrip("/") + path
        self.requests_sent += 1
        try:
            response = await self._client.request(
                method,
                url,
                json=json,
                files=files,
                data=data,
                params=params,
                headers={**dict(target.headers), **(headers or {})},
                extensions={INTERNAL: True},
            )
        except httpx.TransportError as e:
            raise TransientHTTPError(f"{method} {url}: {type(e).__name__}: {e}") from e
        status = response.status_code
        if status in _RETRY_STATUS or status >= 500:
            raise TransientHTTPError(
                f"{method} {url}: HTTP {status}: {response.text[:300]}",
                status,
                retry_after_s(response.headers),
            )
        if status >= 400:
            raise ProviderHTTPError(f"{method} {url}: HTTP {status}: {response.text[:500]}", status)
        return response
