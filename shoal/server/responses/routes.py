"""`/v1/responses`: create (plain, streamed, background), retrieve (and replay a background
response's stream), delete, cancel, list input items, count input tokens.

Every answer to a create carries `X-Session-Id`, the chain's id, so a cluster's ingress learns
where the chain's KV lives; tool types shoal cannot run are left out with a `Warning` header
naming them. A client that goes away aborts its response, unless it runs in the background.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from shoal.server.errors import APIError
from shoal.server.formatting import list_page
from shoal.server.quota import Output, Outputs
from shoal.server.responses.events import Sequenced, sse
from shoal.server.responses.protocol import InputTokensRequest, ResponseCreateRequest
from shoal.server.responses.service import Pending, Responses
from shoal.server.routes import admit, metered, streaming
from shoal.server.state import ServerState, get_state
from shoal.server.tenancy import Tenant, get_tenant

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]
SESSION_HEADER = "X-Session-Id"


def _service(state: ServerState) -> Responses:
    if state.responses is None:
        raise APIError(503, "the Responses API is not ready")
    return state.responses


def _headers(p: Pending) -> dict[str, str]:
    headers = {SESSION_HEADER: p.chain}
    if p.dropped:
        names = ", ".join(sorted(set(p.dropped)))
        headers["Warning"] = f'299 shoal "tools shoal cannot run were left out: {names}"'
    return headers


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[bytes]:
    async for event in events:
        yield sse(event)


async def _replay(events: list[dict[str, Any]], after: int) -> AsyncIterator[dict[str, Any]]:
    for event in events:
        if event["sequence_number"] > after:
            yield event


@router.post("/v1/responses")
async def create_response(
    request: Request, state: State, tenant: Caller, req: ResponseCreateRequest
) -> Response:
    svc = _service(state)
    p = await svc.prepare(req, tenant)
    headers = _headers(p)
    meter = await admit(request, state, tenant, p.prep)
    if req.background:
        await meter.done(None)  # the reservation stands: nobody waits for the answer here
        running = await svc.launch(p)
        if req.stream:
            return streaming(_sse(running.log.follow()), headers)
        return JSONResponse(p.frame.response("queued"), headers=headers)

    def events(gen: Outputs, first: Output) -> AsyncGenerator[bytes]:
        return _sse(svc.events(p, gen, first[1], Sequenced()))

    return await metered(
        request,
        meter,
        state.serving,
        p.prep,
        events if req.stream else None,
        lambda: svc.respond(p),
        lambda body: body["usage"]["total_tokens"] if body["usage"] else None,
        headers,
    )


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(
    state: State, tenant: Caller, req: InputTokensRequest
) -> dict[str, Any]:
    count = await _service(state).input_tokens(req, tenant)
    return {"object": "response.input_tokens", "input_tokens": count}


@router.get("/v1/responses/{response_id}")
async def get_response(
    state: State,
    tenant: Caller,
    response_id: str,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> Response:
    svc = _service(state)
    found = await svc.get(response_id, tenant)
    if not stream:
        return JSONResponse(found.obj)
    if not found.obj.get("background"):
        raise APIError(400, "only a background response can be streamed", param="stream")
    running = svc.background.get(response_id)
    if running is not None:
        events = running.log.follow(starting_after)
    else:  # finished: its stored events (read again: it may have just finished)
        events = _replay((await svc.get(response_id, tenant)).events or [], starting_after)
    return streaming(_sse(events))


@router.delete("/v1/responses/{response_id}")
async def delete_response(state: State, tenant: Caller, response_id: str) -> dict[str, Any]:
    await _service(state).delete(response_id, tenant)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(state: State, tenant: Caller, response_id: str) -> dict[str, Any]:
    return await _service(state).cancel(response_id, tenant)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    state: State,
    tenant: Caller,
    response_id: str,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    items = (await _service(state).get(response_id, tenant)).items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise APIError(400, f"after: no input item '{after}' in this response", param="after")
        items = items[at + 1 :]
    return list_page(items[:limit], len(items) > limit)
