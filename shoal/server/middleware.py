"""ASGI middleware: API-key auth (constant-time; `Authorization: Bearer` or Anthropic's
`x-api-key`), body-size limits, 503 while shutting down.

Plain ASGI rather than FastAPI dependencies, so these checks run before any body is read or
parsed: an unauthorized or oversized request costs no memory, and a request arriving during
shutdown is refused before it can reach the engine.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.server.errors import body_for

OPEN_PATHS = ("/health", "/metrics")
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
        api_key: str | None,
        max_body: int,
        max_upload: int,
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.max_upload = max_upload

    @staticmethod
    def _shutting_down(scope: Scope) -> bool:
        state = getattr(scope["app"].state, "shoal", None)
        return state is not None and bool(state.shutting_down)

    def _authorized(self, scope: Scope) -> bool:
        if self.key is None or scope["path"] in OPEN_PATHS:
            return True
        header, api_key = b"", None
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v
            elif k == b"x-api-key":  # Anthropic's SDKs send the key here
                api_key = v
        if api_key is not None:
            return hmac.compare_digest(api_key.strip(), self.key)
        scheme, _, token = header.partition(b" ")
        # Compare in constant time whatever the input (a wrong scheme compares too).
        ok = hmac.compare_digest(token.strip(), self.key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._shutting_down(scope) and scope["path"] != "/metrics":
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
