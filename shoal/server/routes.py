"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`.

The HTTP-only parts of serving live here: streaming responses that abort their requests when
the client disconnects, and non-streaming ones cancelled the same way; everything shared with
the Batch API is in `serving`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from shoal.server.errors import model_not_found
from shoal.server.protocol import ChatCompletionRequest, CompletionRequest
from shoal.server.quota import UNMETERED, Meter, Output, Outputs, Unmetered
from shoal.server.serving import (
    Prepared,
    Serving,
    prepare_chat,
    prepare_completion,
    respond,
    start_stream,
    stream_sse,
)
from shoal.server.state import ServerState, get_state
from shoal.server.tenancy import Tenant, get_tenant

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]
SessionHeader = Annotated[str | None, Header(alias="X-Session-Id")]
T = TypeVar("T")
_STARTED = int(time.time())


class SSEResponse(StreamingResponse):
    """Closes its body generator however the response ends, so a client that disconnects
    aborts its request at once rather than when the generator is garbage-collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client goes away first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


StreamBody = Callable[[Outputs, Output], AsyncGenerator[bytes]]


def streaming(body: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> SSEResponse:
    """Server-sent events, which proxies must pass on as they come."""
    headers = {**(headers or {}), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SSEResponse(body, media_type="text/event-stream", headers=headers)


async def admit(
    request: Request, state: ServerState, tenant: Tenant, prep: Prepared
) -> Meter | Unmetered:
    """The request's lease on its tenant's budget (`--quota`), or no metering at all."""
    authorization = request.headers.get("authorization")
    return await (state.quota or UNMETERED).admit(tenant, authorization, prep)


async def metered(
    request: Request,
    meter: Meter | Unmetered,
    srv: Serving,
    prep: Prepared,
    stream: StreamBody | None,
    answer: Callable[[], Awaitable[dict[str, Any]]],
    used: Callable[[dict[str, Any]], int | None],
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An admitted request's answer, streamed (`stream` makes the body from its first output
    on) or whole (`answer`), its lease settled with the tokens it `used`; a client that goes
    away aborts it (a whole answer then gets 499)."""
    if stream is not None:
        try:
            gen, first = meter.watch(*await start_stream(srv, prep))
        except BaseException:
            await meter.done(0)
            raise
        return streaming(meter.settling(stream(gen, first)), headers)
    body = None
    try:
        body = await unless_disconnected(request, answer())
    finally:
        await meter.done(None if body is None else used(body))
    if body is None:
        return Response(status_code=499)
    return JSONResponse(body, headers=headers)


async def _serve(
    request: Request, state: ServerState, tenant: Tenant, prep: Prepared, stream: bool
) -> Response:
    srv = state.serving
    return await metered(
        request,
        await admit(request, state, tenant, prep),
        srv,
        prep,
        (lambda gen, first: stream_sse(srv, prep, gen, first)) if stream else None,
        lambda: respond(srv, prep),
        lambda body: int(body["usage"]["total_tokens"]),
    )


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(state: State, model_id: str) -> dict[str, Any]:
    if model_id != state.model_name:
        raise model_not_found(model_id)
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "shoal",
        "max_model_len": state.engine.max_model_len,
    }


@router.post("/v1/completions")
async def completions(
    request: Request,
    state: State,
    tenant: Caller,
    req: CompletionRequest,
    x_session_id: SessionHeader = None,
) -> Response:
    prep = await prepare_completion(state.serving, req, tenant=tenant, session_id=x_session_id)
    return await _serve(request, state, tenant, prep, bool(req.stream))


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request,
    state: State,
    tenant: Caller,
    req: ChatCompletionRequest,
    x_session_id: SessionHeader = None,
) -> Response:
    prep = await prepare_chat(state.serving, req, tenant=tenant, session_id=x_session_id)
    return await _serve(request, state, tenant, prep, bool(req.stream))


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if state.shutting_down:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.model_name})


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)
