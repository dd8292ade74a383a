"""OpenAI-shaped providers (api.openai.com, vLLM, `shoal serve`): Files + Batches.

The batch carries `metadata.shoal_batchify_key` = the intent's tag, so a batch created just
before a crash (its id never recorded) is found again by listing batches: proof, not a guess.
Results merge the output and the error file; an expired or cancelled request becomes its own
typed error, a request the provider rejected keeps its status and body, so the SDK raises what
it would have raised for a direct call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from shoal.batchify.adapters.base import Candidate, Results, Route, Snapshot, recent_batches
from shoal.batchify.adapters.base import jsonl_lines as _lines
from shoal.batchify.calls import Outcome, Target, json_outcome
from shoal.batchify.errors import (
    BatchCancelledError,
    BatchExpiredError,
    BatchFailedError,
    BatchifyError,
)
from shoal.batchify.provider import ProviderHTTP

TAG_KEY = "shoal_batchify_key"
TERMINAL = ("completed", "failed", "expired", "cancelled")
# Longest suffix first: "/chat/completions" also ends with "/completions".
_SUFFIXES = ("/chat/completions", "/completions", "/embeddings", "/responses")
_ACCOUNT = ("authorization", "openai-organization", "openai-project")
_NOT_RUN: dict[str, type[BatchifyError]] = {
    "batch_expired": BatchExpiredError,
    "batch_cancelled": BatchCancelledError,
}


def _created_at(batch: dict[str, Any]) -> float:
    return float(batch.get("created_at") or 0)


class OpenAIAdapter:
    name = "openai"
    max_requests = 50_000
    max_bytes = 200 * 1000 * 1000

    def route(self, method: str, url: str) -> Route | None:
        if method != "POST":
            return None
        for suffix in _SUFFIXES:
            if url.endswith(suffix):
                return Route(url[: -len(suffix)], "/v1" + suffix)
        return None

    def account_headers(self, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple((k, headers[k]) for k in _ACCOUNT if k in headers)

    async def submit(
        self, http: ProviderHTTP, target: Target, items: list[tuple[str, dict[str, Any]]], tag: str
    ) -> str:
        data = "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": target.endpoint, "body": body})
            + "\n"
            for cid, body in items
        ).encode()
        upload = await http.send(
            "POST",
            target,
            "/files",
            files={"file": (f"shoal-batchify-{tag}.jsonl", data, "application/jsonl")},
            data={"purpose": "batch"},
        )
        created = await http.send(
            "POST",
            target,
            "/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": target.endpoint,
                "completion_window": "24h",
                "metadata": {TAG_KEY: tag},
            },
        )
        return str(created.json()["id"])

    async def find_orphans(
        self, http: ProviderHTTP, target: Target, tag: str, n: int, since: float
    ) -> list[Candidate]:
        async for b in recent_batches(http, target, "/batches", since, _created_at, "after"):
            if (b.get("metadata") or {}).get(TAG_KEY) == tag:
                return [Candidate(b["id"], verified=True)]
        return []

    async def poll(self, http: ProviderHTTP, target: Target, batch_id: str) -> Snapshot:
        b = (await http.send("GET", target, f"/batches/{batch_id}")).json()
        counts = b.get("request_counts") or {}
        done, failed = int(counts.get("completed") or 0), int(counts.get("failed") or 0)
        return Snapshot(
            status=str(b["status"]),
            terminal=b["status"] in TERMINAL,
            total=int(counts.get("total") or 0),
            done=done + failed,
            failed=failed,
            raw=b,
        )

    async def results(self, http: ProviderHTTP, target: Target, snap: Snapshot) -> Results:
        b = snap.raw
        out: Results = {}
        if snap.status == "failed":
            errors = (b.get("errors") or {}).get("data") or []
            detail = "; ".join(str(e.get("message")) for e in errors[:5]) or "no detail given"
            raise BatchFailedError(f"batch {b['id']} failed: {detail}")
        for file_id in (b.get("output_file_id"), b.get("error_file_id")):
            if not file_id:
                continue
            content = await http.send("GET", target, f"/files/{file_id}/content")
            for line in _lines(content.content):
                out[line["custom_id"]] = _outcome(line, b["id"])
        return out

    async def cancel(self, http: ProviderHTTP, target: Target, batch_id: str) -> None:
        await http.send("POST", target, f"/batches/{batch_id}/cancel")

    def sdk_error_base(self) -> type[Exception] | None:
        return None  # the openai SDK lets exceptions other than httpx's through unwrapped

    def dry_run_body(self, endpoint: str, body: dict[str, Any], custom_id: str) -> dict[str, Any]:
        model, now = body.get("model"), int(time.time())
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        if endpoint.endswith("/embeddings"):
            inputs = body.get("input")
            count = len(inputs) if isinstance(inputs, list) and inputs else 1
            empty: str | list[float] = "" if body.get("encoding_format") == "base64" else []
            return {
                "object": "list",
                "model": model,
                "data": [
                    {"object": "embedding", "index": i, "embedding": empty} for i in range(count)
                ],
                "usage": {"prompt_tokens": 0, "total_tokens": 0},
            }
        if endpoint.endswith("/responses"):
            return _dry_run_response(f"dryrun-{custom_id}", model, now)
        if endpoint.endswith("/chat/completions"):
            choice: dict[str, Any] = {"message": {"role": "assistant", "content": ""}}
            obj = "chat.completion"
        else:
            choice, obj = {"text": ""}, "text_completion"
        choice.update(index=0, finish_reason="stop", logprobs=None)
        return {
            "id": f"dryrun-{custom_id}",
            "object": obj,
            "created": now,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }


def _dry_run_response(response_id: str, model: Any, now: int) -> dict[str, Any]:
    """An empty, completed Responses API object."""
    text = {"type": "output_text", "text": "", "annotations": []}
    message = {
        "id": f"msg_{response_id}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [text],
    }
    usage = {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }
    return {
        "id": response_id,
        "object": "response",
        "created_at": now,
        "status": "completed",
        "model": model,
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _outcome(line: dict[str, Any], batch_id: str) -> Outcome | BatchifyError:
    response = line.get("response")
    if response:
        headers = {"x-shoal-batch-id": batch_id}
        if response.get("request_id"):
            headers["x-request-id"] = str(response["request_id"])
        return json_outcome(int(response["status_code"]), response.get("body"), headers)
    error = line.get("error") or {}
    code, message = error.get("code"), str(error.get("message") or "no detail given")
    cls = _NOT_RUN.get(str(code), BatchFailedError)
    return cls(f"batch {batch_id}, request {line.get('custom_id')}: {message} ({code})")
