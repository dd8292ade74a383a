"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`.

The HTTP-only parts of serving live here: streaming responses that abort their requests when
the client disconnects, and non-streaming ones cancelled the same way; everything shared with
the Batch API is in `serving`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from shoal.server.errors import model_not_found
from shoal.server.protocol import ChatCompletionRequest, CompletionRequest
from shoal.server.quota import UNMETERED
from shoal.server.serving import (
    Prepared,
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


async def _serve(
    request: Request, state: ServerState, tenant: Tenant, prep: Prepared, stream: bool
) -> Response:
    srv = state.serving
    meter = await (state.quota or UNMETERED).admit(
        tenant, request.headers.get("authorization"), prep
    )
    if stream:
        try:
            gen, first = meter.watch(*await start_stream(srv, prep))
        except BaseException:
            await meter.done(0)
            raise
        return SSEResponse(
            meter.settling(stream_sse(srv, prep, gen, first)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = None
    try:
        body = await unless_disconnected(request, respond(srv, prep))
    finally:
        await meter.done(body["usage"]["total_tokens"] if body else None)
    if body is None:
        return Response(status_code=499)
    return JSONResponse(body)


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
