"""Parsing and validating Batch API input files (JSONL), line by line.

One parser for the upload (`/v1/files`, so bad files are refused at once) and for the batch
runner (which also checks each line's `url` against the batch's endpoint); errors come back
as OpenAI-style objects carrying their line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass(slots=True)
class BatchLine:
    line: int  # 1-based line number in the file
    custom_id: str
    url: str
    body: dict[str, Any]


def _err(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_batch_file(
    data: bytes, *, max_lines: int, endpoint: str | None = None
) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """Every request line, and a list of OpenAI-style errors (empty when the file is valid).

    Blank lines are skipped. With `endpoint`, each line's `url` must equal it.
    """
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [], [_err(1, "invalid_file", "the file is not valid UTF-8")]
    for no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            errors.append(
                _err(no, "too_many_requests", f"a batch holds at most {max_lines} requests")
            )
            break
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(_err(no, "invalid_json_line", f"line {no} is not valid JSON: {e.msg}"))
            continue
        if not isinstance(obj, dict):
            errors.append(_err(no, "invalid_json_line", f"line {no} is not a JSON object"))
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            errors.append(
                _err(
                    no,
                    "missing_required_parameter",
                    f"line {no}: custom_id must be a non-empty string",
                    "custom_id",
                )
            )
            continue
        if cid in seen:
            errors.append(
                _err(
                    no,
                    "duplicate_custom_id",
                    f"line {no}: custom_id {cid!r} is used more than once",
                    "custom_id",
                )
            )
            continue
        seen.add(cid)
        if obj.get("method", "POST") != "POST":
            errors.append(_err(no, "invalid_method", f"line {no}: method must be POST", "method"))
            continue
        url = obj.get("url")
        if url not in ENDPOINTS:
            errors.append(
                _err(
                    no,
                    "invalid_url",
                    f"line {no}: url must be one of {', '.join(ENDPOINTS)}",
                    "url",
                )
            )
            continue
        if endpoint is not None and url != endpoint:
            errors.append(
                _err(
                    no,
                    "mismatched_url",
                    f"line {no}: url {url!r} differs from the batch endpoint {endpoint!r}",
                    "url",
                )
            )
            continue
        body = obj.get("body")
        if not isinstance(body, dict):
            errors.append(
                _err(no, "invalid_body", f"line {no}: body must be a JSON object", "body")
            )
            continue
        if body.get("stream"):
            errors.append(
                _err(
                    no,
                    "invalid_body",
                    f"line {no}: streaming is not supported in a batch",
                    "body.stream",
                )
            )
            continue
        lines.append(BatchLine(no, cid, url, body))
    if not lines and not errors:
        errors.append(_err(1, "empty_file", "the file holds no requests"))
    return lines, errors
