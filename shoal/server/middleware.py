"""ASGI middleware: API-key auth (constant-time; `Authorization: Bearer` or Anthropic's
`x-api-key`), which names the request's tenant (`tenancy.py`), body-size limits, 503 while
shutting down. `/health` is open; `/metrics` too, unless `--metrics-key` guards it.

Plain ASGI rather than FastAPI dependencies, so these checks run before any body is read or
parsed: an unauthorized or oversized request costs no memory, and a request arriving during
shutdown is refused before it can reach the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.server.errors import body_for
from shoal.server.tenancy import TENANT, Tenancy, Tenant

METRICS = "/metrics"
UPLOAD_PATHS = ("/v1/files", "/v1/messages/batches")  # bodies under the upload limit


class _BodyTooLarge(HTTPException):
    """Raised from `receive`: FastAPI passes HTTP exceptions through body parsing."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


async def _send_error(
    send: Send, scope: Scope, status: int, message: str, headers: dict[str, str]
) -> None:
    body = json.dumps(body_for(scope["path"], status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The first thing every request meets."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tenancy: Tenancy,
        metrics_key: str | None,
        max_body: int,
        max_upload: int,
    ) -> None:
        self.app = app
        self.tenancy = tenancy
        self.metrics_key = _digest(metrics_key.encode()) if metrics_key else None
        self.max_body = max_body
        self.max_upload = max_upload

    @staticmethod
    def _shutting_down(scope: Scope) -> bool:
        state = getattr(scope["app"].state, "shoal", None)
        return state is not None and bool(state.shutting_down)

    def _authorized(self, scope: Scope) -> bool:
        """Whether the request may go on; a tenant's request learns its tenant."""
        path = scope["path"]
        if path == "/health":
            return True
        key = presented_key(scope)
        if path == METRICS:
            return self.metrics_key is None or (
                key is not None and hmac.compare_digest(_digest(key), self.metrics_key)
            )
        tenant: Tenant | None = self.tenancy.authenticate(key)
        scope[TENANT] = tenant
        return tenant is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._shutting_down(scope) and scope["path"] != METRICS:
            await _send_error(send, scope, 503, "the server is shutting down", {"Retry-After": "5"})
            return
        if not self._authorized(scope):
            await _send_error(
                send, scope, 401, "Incorrect API key provided.", {"WWW-Authenticate": "Bearer"}
            )
            return
        limit = self.max_upload if scope["path"] in UPLOAD_PATHS else self.max_body
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                await _send_error(send, scope, 413, f"the request body exceeds {limit} bytes", {})
                return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, scope, 413, f"the request body exceeds {limit} bytes", {})


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key.strip()).digest()


def presented_key(scope: Scope) -> bytes | None:
    """The key a request presents: `x-api-key` (Anthropic's SDKs), else a Bearer token."""
    header = None
    for k, v in scope.get("headers", []):
        if k == b"x-api-key":
            return bytes(v)
        if k == b"authorization":
            header = bytes(v)
    if header is None:
        return None
    scheme, _, token = header.partition(b" ")
    return token if scheme.lower() == b"bearer" else None
