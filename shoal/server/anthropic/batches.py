"""Message Batches: create, get, list (before_id / after_id / limit), results, cancel, delete.

A message batch is stored as a runner batch over `/v1/messages` lines (its requests written as
an input file), so it runs, survives restarts and finalizes exactly like an OpenAI batch;
these routes only translate. Params are validated whole at creation and stored as sent. A
message batch is its tenant's: another tenant gets 404.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from shoal.server.anthropic import formatting as fmt
from shoal.server.anthropic.protocol import MessageBatchCreate, MessagesRequest
from shoal.server.batch_runner import TERMINAL, BatchStatus
from shoal.server.batches import live, request_cancel, start_batch
from shoal.server.errors import APIError, not_found
from shoal.server.ids import new_id
from shoal.server.jsonl import MESSAGES, split_lines
from shoal.server.state import ServerState, get_state
from shoal.server.tenancy import Tenant, get_tenant

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]
PREFIX = "/v1/messages/batches"


def _get(state: ServerState, tenant: Tenant, batch_id: str) -> dict[str, Any]:
    obj = state.store.get_batch(batch_id, tenant=tenant.name)
    if obj is None or obj["endpoint"] != MESSAGES:
        raise not_found("message batch", batch_id)
    return live(state, obj)


def _shape(request: Request, obj: dict[str, Any]) -> dict[str, Any]:
    url = f"{str(request.base_url).rstrip('/')}{PREFIX}/{obj['id']}/results"
    return fmt.message_batch(obj, url)


def _input_file(req: MessageBatchCreate) -> bytes:
    lines, seen = [], set()
    for i, item in enumerate(req.requests):
        if item.custom_id in seen:
            raise APIError(400, f"requests.{i}.custom_id: {item.custom_id!r} is used twice")
        seen.add(item.custom_id)
        try:
            params = MessagesRequest.model_validate(item.params)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise APIError(400, f"requests.{i}.params.{where}: {first['msg']}") from e
        if params.stream:
            raise APIError(400, f"requests.{i}.params.stream: a batch cannot stream")
        line = {"custom_id": item.custom_id, "method": "POST", "url": MESSAGES}
        lines.append(json.dumps({**line, "body": item.params}))
    return ("\n".join(lines) + "\n").encode()


@router.post(PREFIX)
async def create(
    request: Request, state: State, tenant: Caller, req: MessageBatchCreate
) -> dict[str, Any]:
    data = _input_file(req)
    name = f"{new_id('msgbatch_input_')}.jsonl"
    f = state.store.create_file(name, "batch", data, tenant=tenant.name)
    obj = start_batch(
        state, tenant, MESSAGES, f["id"], None, id_prefix="msgbatch_", total=len(req.requests)
    )
    return _shape(request, obj)


@router.get(PREFIX)
async def list_batches(
    request: Request,
    state: State,
    tenant: Caller,
    before_id: str | None = None,
    after_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> dict[str, Any]:
    data, has_more = state.store.list_batches(
        tenant=tenant.name, after=after_id, before=before_id, limit=limit, endpoints=(MESSAGES,)
    )
    page = [_shape(request, live(state, b)) for b in data]
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


@router.get(PREFIX + "/{batch_id}")
async def get(request: Request, state: State, tenant: Caller, batch_id: str) -> dict[str, Any]:
    return _shape(request, _get(state, tenant, batch_id))


def _result_lines(state: ServerState, tenant: Tenant, obj: dict[str, Any]) -> Iterator[bytes]:
    for key in ("output_file_id", "error_file_id"):
        if not obj.get(key):
            continue
        for raw in split_lines(state.store.read_file(obj[key], tenant=tenant.name) or ()):
            if raw.strip():
                yield json.dumps(fmt.result_line(json.loads(raw))).encode() + b"\n"


@router.get(PREFIX + "/{batch_id}/results")
async def results(state: State, tenant: Caller, batch_id: str) -> StreamingResponse:
    obj = _get(state, tenant, batch_id)
    if obj["status"] not in TERMINAL:
        raise APIError(400, f"message batch {batch_id} has not ended yet")
    lines = _result_lines(state, tenant, obj)
    return StreamingResponse(lines, media_type="application/x-jsonl")


@router.post(PREFIX + "/{batch_id}/cancel")
async def cancel(request: Request, state: State, tenant: Caller, batch_id: str) -> dict[str, Any]:
    obj = _get(state, tenant, batch_id)
    if obj["status"] not in (*TERMINAL, BatchStatus.CANCELLING, BatchStatus.FINALIZING):
        request_cancel(state, batch_id)
        obj = _get(state, tenant, batch_id)
    return _shape(request, obj)


@router.delete(PREFIX + "/{batch_id}")
async def delete(state: State, tenant: Caller, batch_id: str) -> dict[str, Any]:
    obj = _get(state, tenant, batch_id)
    if obj["status"] not in TERMINAL:
        raise APIError(400, f"message batch {batch_id} is still processing; cancel it first")
    state.store.delete_batch(batch_id)
    for key in ("input_file_id", "output_file_id", "error_file_id"):
        if obj.get(key):
            state.store.delete_file(obj[key], tenant=tenant.name)
    return {"id": batch_id, "type": "message_batch_deleted"}
