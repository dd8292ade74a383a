"""What a batch leaves behind, in the OpenAI Batch API's shapes: one result line per request,
and the output and error files a finalizer writes from the stored results."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from shoal.server.ids import new_id
from shoal.server.store import BatchStatus, OutputFile

_NOT_RUN = {
    BatchStatus.EXPIRED: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    BatchStatus.CANCELLED: (
        "batch_cancelled",
        "This request was not executed because the batch was cancelled.",
    ),
}


def result_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """The output-file line of one answered request (any status: errors are answers too)."""
    rid = body.get("id") if status == 200 else None
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": rid or new_id("req_"), "body": body},
        "error": None,
    }


def output_files(
    batch_id: str,
    status: BatchStatus,
    results: Iterable[tuple[bool, str]],
    not_run: Iterable[str],
) -> tuple[list[OutputFile], dict[str, str | None]]:
    """The output and error files of a batch ending with `status`: stored results (`(ok,
    line)`, in line order), then a line for each request that never ran (cancelled or
    expired); and the batch fields that name them."""
    out: list[str] = []
    err: list[str] = []
    for ok, body in results:
        (out if ok else err).append(body)
    if status in _NOT_RUN:
        code, message = _NOT_RUN[status]
        error = {"code": code, "message": message}
        for custom_id in not_run:
            line = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None}
            err.append(json.dumps({**line, "error": error}))
    files: list[OutputFile] = []
    fields: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
    for key, rows, suffix in (("output_file_id", out, "output"), ("error_file_id", err, "errors")):
        if rows:
            fid = f"file-{batch_id.removeprefix('batch_')}{suffix[0]}"
            content = ("\n".join(rows) + "\n").encode()
            files.append(OutputFile(fid, f"{batch_id}_{suffix}.jsonl", content))
            fields[key] = fid
    return files, fields
