"""In-memory OpenAI Batch and Anthropic Message Batches providers behind `httpx.MockTransport`,
for what a live server does not do on demand: 5xx and 429 with Retry-After while polling,
shuffled output, expired and errored lines, batches that vanish or never end."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx


def reply_text(body: dict[str, Any]) -> str:
    """What the fakes answer: the last message's text, echoed (so mix-ups show)."""
    content = body["messages"][-1]["content"]
    return f"echo {content if isinstance(content, str) else json.dumps(content)}"


@dataclass
class _Fake:
    poll_failures: list[httpx.Response] = field(default_factory=list)  # served before polls
    hold: bool = False  # batches never end
    special: dict[str, str] = field(default_factory=dict)  # prompt text -> outcome kind
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handle(request)

    def handle(self, request: httpx.Request) -> httpx.Response:
        raise NotImplementedError

    def _poll_failure(self) -> httpx.Response | None:
        return self.poll_failures.pop(0) if self.poll_failures else None

    def kind(self, body: dict[str, Any]) -> str:
        return self.special.get(reply_text(body).removeprefix("echo "), "ok")


class FakeOpenAI(_Fake):
    def handle(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if method == "POST" and path == "/v1/files":
            text = request.content.decode()
            lines = [json.loads(ln) for ln in text.splitlines() if ln.startswith('{"custom_id"')]
            fid = f"file-{len(self.batches)}-{random.randrange(10**9)}"
            self.batches.setdefault("_files", {})[fid] = lines
            return httpx.Response(200, json={"id": fid, "object": "file", "purpose": "batch"})
        if method == "POST" and path == "/v1/batches":
            body = json.loads(request.content)
            bid = f"batch_{len(self.batches)}"
            lines = self.batches["_files"][body["input_file_id"]]
            self.batches[bid] = {
                "id": bid,
                "status": "in_progress",
                "metadata": body.get("metadata"),
                "created_at": 0,
                "lines": lines,
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
            }
            return httpx.Response(200, json=self._public(bid))
        if method == "GET" and path == "/v1/batches":
            data = [self._public(b) for b in reversed(self.batches) if b != "_files"]
            return httpx.Response(200, json={"data": data, "has_more": False})
        m = re.fullmatch(r"/v1/batches/([^/]+)(/cancel)?", path)
        if m and m.group(1) not in self.batches:
            return httpx.Response(404, json={"error": {"message": "no such batch"}})
        if m and m.group(2):
            self.cancelled.append(m.group(1))
            self.batches[m.group(1)]["status"] = "cancelling"
            return httpx.Response(200, json=self._public(m.group(1)))
        if m:
            failure = self._poll_failure()
            if failure is not None:
                return failure
            b = self.batches[m.group(1)]
            if not self.hold and b["status"] == "in_progress":
                self._finish(b)
            return httpx.Response(200, json=self._public(b["id"]))
        m = re.fullmatch(r"/v1/files/([^/]+)/content", path)
        if m:
            lines = self.batches["_files"][m.group(1)]
            return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines))
        return httpx.Response(404, json={"error": {"message": f"no route {method} {path}"}})

    def _public(self, bid: str) -> dict[str, Any]:
        return {k: v for k, v in self.batches[bid].items() if k != "lines"}

    def _finish(self, b: dict[str, Any]) -> None:
        out, err = [], []
        for ln in b["lines"]:
            kind = self.kind(ln["body"])
            if kind == "expired":
                err.append(
                    {
                        "custom_id": ln["custom_id"],
                        "response": None,
                        "error": {"code": "batch_expired", "message": "not run in time"},
                    }
                )
                continue
            status = 400 if kind == "bad" else 200
            body: dict[str, Any] = (
                {"error": {"message": "bad request", "type": "invalid_request_error"}}
                if kind == "bad"
                else {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": ln["body"]["model"],
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": reply_text(ln["body"])},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                }
            )
            line = {
                "custom_id": ln["custom_id"],
                "error": None,
                "response": {"status_code": status, "request_id": "req_1", "body": body},
            }
            (out if status == 200 else err).append(line)
        random.Random(0).shuffle(out)  # output order is not input order
        files = self.batches["_files"]
        b["output_file_id"], b["error_file_id"] = f"{b['id']}-out", f"{b['id']}-err"
        files[b["output_file_id"]], files[b["error_file_id"]] = out, err
        b["status"] = "completed"
        b["request_counts"] = {"total": len(b["lines"]), "completed": len(out), "failed": len(err)}


class FakeAnthropic(_Fake):
    def handle(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if method == "POST" and path == "/v1/messages/batches":
            bid = f"msgbatch_{len(self.batches)}"
            self.batches[bid] = {
                "id": bid,
                "type": "message_batch",
                "processing_status": "in_progress",
                "created_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
                "requests": json.loads(request.content)["requests"],
                "request_counts": {
                    "processing": 0,
                    "succeeded": 0,
                    "errored": 0,
                    "canceled": 0,
                    "expired": 0,
                },
            }
            self.batches[bid]["request_counts"]["processing"] = len(self.batches[bid]["requests"])
            return httpx.Response(200, json=self._public(bid))
        if method == "GET" and path == "/v1/messages/batches":
            data = [self._public(b) for b in reversed(self.batches)]
            return httpx.Response(200, json={"data": data, "has_more": False})
        m = re.fullmatch(r"/v1/messages/batches/([^/]+)(/results)?", path)
        if m and m.group(1) not in self.batches:
            return httpx.Response(
                404, json={"type": "error", "error": {"type": "not_found_error", "message": "gone"}}
            )
        if m and m.group(2):
            rows = [self._result(r) for r in self.batches[m.group(1)]["requests"]]
            return httpx.Response(200, content="".join(json.dumps(r) + "\n" for r in rows))
        if m:
            failure = self._poll_failure()
            if failure is not None:
                return failure
            b = self.batches[m.group(1)]
            if not self.hold:
                b["processing_status"] = "ended"
                b["request_counts"] = {
                    "processing": 0,
                    "succeeded": len(b["requests"]),
                    "errored": 0,
                    "canceled": 0,
                    "expired": 0,
                }
            return httpx.Response(200, json=self._public(b["id"]))
        return httpx.Response(
            404, json={"type": "error", "error": {"type": "not_found_error", "message": path}}
        )

    def _public(self, bid: str) -> dict[str, Any]:
        return {k: v for k, v in self.batches[bid].items() if k != "requests"}

    def _result(self, req: dict[str, Any]) -> dict[str, Any]:
        kind, params = self.kind(req["params"]), req["params"]
        if kind in ("expired", "canceled"):
            return {"custom_id": req["custom_id"], "result": {"type": kind}}
        if kind in ("rate_limit_error", "invalid_request_error"):
            error = {"type": "error", "error": {"type": kind, "message": kind}}
            return {"custom_id": req["custom_id"], "result": {"type": "errored", "error": error}}
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": params["model"],
            "content": [{"type": "text", "text": reply_text(params)}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
        return {"custom_id": req["custom_id"], "result": {"type": "succeeded", "message": message}}
