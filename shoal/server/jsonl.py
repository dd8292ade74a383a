"""Parsing and validating Batch API input files (JSONL), one line at a time.

One checker for the upload (`/v1/files`, so bad files are refused at once, validated while
the file streams to disk) and for the batch runner (which also checks each line's `url`
against the batch's endpoint); errors come back as OpenAI-style objects carrying their line
number. Nothing here holds a whole file in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from shoal.server.ids import MAX_ID, storable

# What /v1/batches accepts.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"  # Anthropic Message Batches, run by the same runner
RUNNABLE = (*ENDPOINTS, MESSAGES)
CHUNK = 1 << 20


@dataclass(slots=True)
class BatchLine:
    line: int  # 1-based line number in the file
    custom_id: str
    url: str
    body: dict[str, Any]


def _err(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def read_chunks(f: BinaryIO, size: int = CHUNK) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a byte stream (without their newlines), however the chunks fall."""
    tail = b""
    for chunk in chunks:
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        yield from lines
    if tail:
        yield tail


@dataclass
class BatchFileChecker:
    """Feed it a file's lines in order; it keeps the errors (and, if asked, the lines)."""

    max_lines: int
    endpoint: str | None = None  # when set (a created batch), each line's `url` must equal it
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_lines: int = 0
    _seen: set[str] = field(default_factory=set)
    _no: int = 0

    def feed(self, raw: bytes) -> BatchLine | None:
        """Check the next line; the request it holds, or None (blank, or an error recorded)."""
        self._no += 1
        no = self._no
        if not raw.strip():
            return None
        if self.num_lines + len(self.errors) >= self.max_lines:
            if not any(e["code"] == "too_many_requests" for e in self.errors):
                msg = f"a batch holds at most {self.max_lines} requests"
                self.errors.append(_err(no, "too_many_requests", msg))
            return None
        line = self._check(no, raw)
        if line is not None:
            self.num_lines += 1
        return line

    def finish(self) -> list[dict[str, Any]]:
        if not self.num_lines and not self.errors:
            self.errors.append(_err(1, "empty_file", "the file holds no requests"))
        return self.errors

    def _fail(self, no: int, code: str, message: str, param: str | None = None) -> None:
        self.errors.append(_err(no, code, f"line {no}: {message}", param))

    def _check(self, no: int, raw: bytes) -> BatchLine | None:
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError:
            self._fail(no, "invalid_file", "not valid UTF-8")
            return None
        except json.JSONDecodeError as e:
            self._fail(no, "invalid_json_line", f"not valid JSON: {e.msg}")
            return None
        if not isinstance(obj, dict):
            self._fail(no, "invalid_json_line", "not a JSON object")
            return None
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            msg = "custom_id must be a non-empty string"
            self._fail(no, "missing_required_parameter", msg, "custom_id")
            return None
        if not storable(cid):
            msg = f"custom_id must be at most {MAX_ID} characters of text, without NUL"
            self._fail(no, "invalid_custom_id", msg, "custom_id")
            return None
        if cid in self._seen:
            msg = f"custom_id {cid!r} is used more than once"
            self._fail(no, "duplicate_custom_id", msg, "custom_id")
            return None
        self._seen.add(cid)
        url = obj.get("url")
        body = obj.get("body")
        if obj.get("method", "POST") != "POST":
            self._fail(no, "invalid_method", "method must be POST", "method")
        elif not isinstance(url, str) or url not in (RUNNABLE if self.endpoint else ENDPOINTS):
            self._fail(no, "invalid_url", f"url must be one of {', '.join(ENDPOINTS)}", "url")
        elif self.endpoint is not None and url != self.endpoint:
            msg = f"url {url!r} differs from the batch endpoint {self.endpoint!r}"
            self._fail(no, "mismatched_url", msg, "url")
        elif not isinstance(body, dict):
            self._fail(no, "invalid_body", "body must be a JSON object", "body")
        elif body.get("stream"):
            self._fail(no, "invalid_body", "streaming is not supported in a batch", "body.stream")
        else:
            return BatchLine(no, cid, url, body)
        return None


def parse_batch_file(
    chunks: Iterable[bytes], *, max_lines: int, endpoint: str | None = None, keep: bool = True
) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The request lines of a file given as byte chunks (none unless `keep`: validating an
    upload holds no lines), and its errors (empty when the file is valid)."""
    checker = BatchFileChecker(max_lines, endpoint)
    lines = []
    for raw in split_lines(chunks):
        line = checker.feed(raw)
        if keep and line is not None:
            lines.append(line)
    return lines, checker.finish()
