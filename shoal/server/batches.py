"""`/v1/batches`: create, get, list (paginated with `after` and `limit`), cancel.

Routes only read and write batch objects; running them is the `BatchRunner`'s job. A batch
is its tenant's (its lines run as that tenant): another tenant gets 404.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from shoal.server.batch_runner import ACTIVE, TERMINAL, BatchStatus
from shoal.server.errors import APIError, not_found
from shoal.server.formatting import batch_usage, list_page
from shoal.server.ids import new_id
from shoal.server.jsonl import ENDPOINTS
from shoal.server.protocol import BatchCreateRequest
from shoal.server.state import ServerState, get_state
from shoal.server.tenancy import Tenant, get_tenant

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]

WINDOWS = {"24h": 24 * 3600}


def live(state: ServerState, obj: dict[str, Any]) -> dict[str, Any]:
    """Fill in counts of a running batch from the results table."""
    if obj["status"] in ACTIVE and obj.get("request_counts"):
        completed, failed, pt, ct = state.store.result_counts(obj["id"])
        obj["request_counts"] = {**obj["request_counts"], "completed": completed, "failed": failed}
        obj["usage"] = batch_usage(pt, ct)
    return obj


def get_live(state: ServerState, tenant: Tenant, batch_id: str) -> dict[str, Any]:
    obj = state.store.get_batch(batch_id, tenant=tenant.name)
    if obj is None:
        raise not_found("batch", batch_id, "batch_id")
    return live(state, obj)


@router.post("/v1/batches")
async def create_batch(state: State, tenant: Caller, req: BatchCreateRequest) -> dict[str, Any]:
    if req.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if req.completion_window not in WINDOWS:
        raise APIError(400, "completion_window must be '24h'", param="completion_window")
    for k, v in (req.metadata or {}).items():
        if len(k) > 64 or len(v) > 512:
            raise APIError(
                400, "metadata keys hold at most 64 characters and values 512", param="metadata"
            )
    f = state.store.get_file(req.input_file_id, tenant=tenant.name)
    if f is None:
        raise not_found("file", req.input_file_id, "input_file_id")
    if f["purpose"] != "batch":
        raise APIError(400, "the input file must have purpose 'batch'", param="input_file_id")
    return start_batch(state, tenant, req.endpoint, req.input_file_id, req.metadata)


def start_batch(
    state: ServerState,
    tenant: Tenant,
    endpoint: str,
    input_file_id: str,
    metadata: dict[str, str] | None,
    *,
    id_prefix: str = "batch_",
    total: int = 0,
) -> dict[str, Any]:
    """Record a new batch over a stored input file and hand it to the runner (the OpenAI
    Batch API and Anthropic's Message Batches both start here)."""
    now = int(time.time())
    window = state.config.batch_window_s or WINDOWS["24h"]
    obj: dict[str, Any] = {
        "id": new_id(id_prefix),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": "24h",
        "status": BatchStatus.VALIDATING,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + window,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
        "model": None,
        "usage": None,
    }
    state.store.create_batch(obj, tenant=tenant.name)
    state.runner.submit(obj["id"])
    return obj


@router.get("/v1/batches/{batch_id}")
async def get_batch(state: State, tenant: Caller, batch_id: str) -> dict[str, Any]:
    return get_live(state, tenant, batch_id)


@router.get("/v1/batches")
async def list_batches(
    state: State,
    tenant: Caller,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    data, has_more = state.store.list_batches(
        tenant=tenant.name, after=after, limit=limit, endpoints=ENDPOINTS
    )
    data = [live(state, b) for b in data]
    return list_page(data, has_more)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(state: State, tenant: Caller, batch_id: str) -> dict[str, Any]:
    obj = get_live(state, tenant, batch_id)
    status = BatchStatus(obj["status"])
    if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return obj
    if status in TERMINAL or status is BatchStatus.FINALIZING:
        raise APIError(400, f"cannot cancel a batch whose status is {status}", param="batch_id")
    request_cancel(state, batch_id)
    return get_live(state, tenant, batch_id)


def request_cancel(state: ServerState, batch_id: str) -> None:
    """Mark a batch that has not closed yet `cancelling`; the runners stop its lines on
    every replica and one of them finalizes it `cancelled`."""
    if state.store.update_batch(
        batch_id,
        expect=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
        status=BatchStatus.CANCELLING,
        cancelling_at=int(time.time()),
    ):
        state.runner.cancel(batch_id)
