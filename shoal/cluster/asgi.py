"""Hosts an ASGI app (the `shoal serve` FastAPI app) inside a process that is not an HTTP server:
its lifespan runs as uvicorn would run it, and each forwarded request is answered as a stream
of parts, a `ResponseHead` and then body chunks, so streaming (SSE) passes through unchanged.

Closing the stream early (the client went away) tells the app `http.disconnect`, which aborts
the request's engine work as it does under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp

Message = MutableMapping[str, Any]


@dataclass(slots=True)
class Forwarded:
    """One HTTP request, as the ingress received it."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]


class AsgiHost:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._lifespan: asyncio.Future[None] | None = None
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()

    async def start(self) -> None:
        """Run the app's startup (the engine loads); raises if it failed."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        lifespan = self.app(scope, self._to_app.get, self._from_app.put)
        self._lifespan = asyncio.ensure_future(lifespan)
        await self._lifespan_step("startup")

    async def stop(self) -> None:
        """Run the app's shutdown (drain, save sessions, close the store)."""
        if self._lifespan is None or self._lifespan.done():
            return
        await self._lifespan_step("shutdown")
        with contextlib.suppress(Exception):
            await self._lifespan

    async def _lifespan_step(self, step: str) -> None:
        assert self._lifespan is not None
        await self._to_app.put({"type": f"lifespan.{step}"})
        reply = asyncio.ensure_future(self._from_app.get())
        waiting: set[asyncio.Future[Any]] = {reply, self._lifespan}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            self._lifespan.result()  # the app raised: re-raise here
            raise RuntimeError(f"the app ended its lifespan during {step}")
        message = reply.result()
        if message["type"] == f"lifespan.{step}.failed":
            raise RuntimeError(f"{step} failed: {message.get('message', '')}")

    async def serve(self, request: Forwarded) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer to `request`: its head, then its body in the chunks it sent."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "root_path": "",
            "query_string": request.query,
            "headers": request.headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
        }
        sent: asyncio.Queue[Message] = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive() -> Message:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task: asyncio.Future[None] = asyncio.ensure_future(self.app(scope, receive, sent.put))
        try:
            while True:
                message = await _next(sent, task)
                if message is None:
                    return
                if message["type"] == "http.response.start":
                    yield ResponseHead(message["status"], list(message.get("headers", [])))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()
            if not task.done():  # let the app see the disconnect and abort, then stop it
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                task.cancel()


async def _next(sent: asyncio.Queue[Message], task: asyncio.Future[None]) -> Message | None:
    """The app's next message, or None once it returned having sent everything."""
    if not sent.empty():
        return sent.get_nowait()
    getter = asyncio.ensure_future(sent.get())
    waiting: set[asyncio.Future[Any]] = {getter, task}
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    if not sent.empty():
        return sent.get_nowait()
    task.result()  # the app raised without answering: re-raise
    return None
