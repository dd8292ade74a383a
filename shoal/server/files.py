"""`/v1/files`: upload (multipart), list, get, content, delete.

A `purpose=batch` upload is validated line by line at upload time, so a bad file fails where
the client can still see why, not hours later inside a batch. Deleting a file that a running
batch still reads is refused. A file is its tenant's: another tenant gets 404.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, BinaryIO, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from shoal.server.batch_runner import ACTIVE
from shoal.server.errors import APIError, not_found
from shoal.server.formatting import list_page
from shoal.server.ids import storable
from shoal.server.jsonl import parse_batch_file, read_chunks
from shoal.server.state import ServerState, get_state
from shoal.server.tenancy import Tenant, get_tenant

router = APIRouter()

PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]


@router.post("/v1/files")
async def upload_file(
    state: State,
    tenant: Caller,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    if purpose not in PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}", param="purpose")
    # The body is already spooled to a temporary file (the middleware capped its size); copy
    # it to the store in chunks, checking batch files line by line on the way, off the loop.
    name = file.filename or "upload.jsonl"
    if not storable(name):
        raise APIError(400, "the file name must be 1..512 characters of text", param="file")
    return await asyncio.to_thread(_store_upload, state, file.file, name, purpose, tenant.name)


def _store_upload(
    state: ServerState, src: BinaryIO, name: str, purpose: str, tenant: str
) -> dict[str, Any]:
    if purpose == "batch":  # checked first, line by line, then copied: two streaming passes
        _, errors = parse_batch_file(
            read_chunks(src), max_lines=state.config.max_batch_lines, keep=False
        )
        if errors:
            shown = "; ".join(e["message"] for e in errors[:5])
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            msg = f"invalid batch file: {shown}{more}"
            raise APIError(400, msg, param="file", code=errors[0]["code"])
        src.seek(0)
    return state.store.create_file(name, purpose, read_chunks(src), tenant=tenant)


@router.get("/v1/files")
async def list_files(
    state: State,
    tenant: Caller,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    data, has_more = state.store.list_files(
        tenant=tenant.name, purpose=purpose, after=after, limit=limit, order=order
    )
    return list_page(data, has_more)


def _file(state: ServerState, tenant: Tenant, file_id: str) -> dict[str, Any]:
    obj = state.store.get_file(file_id, tenant=tenant.name)
    if obj is None:
        raise not_found("file", file_id, "file_id")
    return obj


@router.get("/v1/files/{file_id}")
async def get_file(state: State, tenant: Caller, file_id: str) -> dict[str, Any]:
    return _file(state, tenant, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(state: State, tenant: Caller, file_id: str) -> StreamingResponse:
    obj = _file(state, tenant, file_id)
    chunks = state.store.read_file(file_id, tenant=tenant.name)
    if chunks is None:
        raise not_found("file", file_id, "file_id")
    headers = {"content-length": str(obj["bytes"])}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@router.delete("/v1/files/{file_id}")
async def delete_file(state: State, tenant: Caller, file_id: str) -> dict[str, Any]:
    _file(state, tenant, file_id)
    users = state.store.batches_using_file(file_id, ACTIVE)
    if users:
        raise APIError(
            400,
            f"the file is the input of batch {users[0]}, which is still running",
            param="file_id",
        )
    state.store.delete_file(file_id, tenant=tenant.name)
    return {"id": file_id, "object": "file", "deleted": True}
