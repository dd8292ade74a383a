"""`/v1/files`: upload (multipart), list, get, content, delete.

A `purpose=batch` upload is validated line by line at upload time, so a bad file fails where
the client can still see why, not hours later inside a batch. Deleting a file that a running
batch still reads is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response

from shoal.server.batch_runner import ACTIVE
from shoal.server.errors import APIError, not_found
from shoal.server.formatting import list_page
from shoal.server.jsonl import parse_batch_file
from shoal.server.state import ServerState, get_state

router = APIRouter()

PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
State = Annotated[ServerState, Depends(get_state)]


@router.post("/v1/files")
async def upload_file(
    state: State,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    if purpose not in PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}", param="purpose")
    limit = state.config.max_upload_bytes
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise APIError(413, f"the file is larger than {limit} bytes", param="file")
    if purpose == "batch":
        _, errors = parse_batch_file(data, max_lines=state.config.max_batch_lines)
        if errors:
            shown = "; ".join(e["message"] for e in errors[:5])
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            first_line = errors[0].get("line")
            raise APIError(
                400,
                f"invalid batch file: {shown}{more}",
                param="file",
                code=errors[0]["code"] if first_line is not None else None,
            )
    return state.store.create_file(file.filename or "upload.jsonl", purpose, data)


@router.get("/v1/files")
async def list_files(
    state: State,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    data, has_more = state.store.list_files(purpose=purpose, after=after, limit=limit, order=order)
    return list_page(data, has_more)


def _file(state: ServerState, file_id: str) -> dict[str, Any]:
    obj = state.store.get_file(file_id)
    if obj is None:
        raise not_found("file", file_id, "file_id")
    return obj


@router.get("/v1/files/{file_id}")
async def get_file(state: State, file_id: str) -> dict[str, Any]:
    return _file(state, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(state: State, file_id: str) -> Response:
    _file(state, file_id)
    try:
        data = state.store.read_file(file_id)
    except FileNotFoundError as e:
        raise not_found("file", file_id, "file_id") from e
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(state: State, file_id: str) -> dict[str, Any]:
    _file(state, file_id)
    users = state.store.batches_using_file(file_id, ACTIVE)
    if users:
        raise APIError(
            400,
            f"the file is the input of batch {users[0]}, which is still running",
            param="file_id",
        )
    state.store.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
