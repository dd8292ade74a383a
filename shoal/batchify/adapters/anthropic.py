"""Anthropic Message Batches (api.anthropic.com and `shoal serve`'s Anthropic routes).

Every request's params travel whole (system blocks, tools, temperature, thinking, metadata...;
only `stream` cannot be batched, and such calls never get here), and the `anthropic-beta` and
`anthropic-version` headers go on the batch call and into the queue key.

Message batches carry no metadata, so an orphan (created just before a crash, its id never
recorded) cannot be proved by a tag. Its custom_ids are derived from the intent's tag, so the
adapter lists the batches created since the intent with as many requests, and the batcher
adopts one only after its results show exactly the intent's custom_ids. Limits: until such a
batch ends its results cannot be read, so the batcher waits on it; if it turns out to be
someone else's, the intent is submitted again after that wait.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from shoal.batchify.adapters.base import (
    CLOCK_SKEW_S,
    Candidate,
    Results,
    Route,
    Snapshot,
    recent_batches,
)
from shoal.batchify.adapters.base import jsonl_lines as _lines
from shoal.batchify.calls import Outcome, Target, json_outcome
from shoal.batchify.errors import BatchCancelledError, BatchExpiredError, BatchifyError
from shoal.batchify.provider import ProviderHTTP

_ACCOUNT = ("x-api-key", "authorization", "anthropic-version", "anthropic-beta")
# The HTTP status a direct call gets for each error type; the SDK picks its exception by it.
ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


def _timestamp(value: Any) -> float:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _created_at(batch: dict[str, Any]) -> float:
    return _timestamp(batch.get("created_at"))


class AnthropicAdapter:
    name = "anthropic"
    max_requests = 100_000
    max_bytes = 256 * 1000 * 1000

    def route(self, method: str, url: str) -> Route | None:
        if method != "POST" or not url.endswith("/messages"):
            return None
        return Route(url.removesuffix("/messages"), "/v1/messages")

    def account_headers(self, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple((k, headers[k]) for k in _ACCOUNT if k in headers)

    async def submit(
        self, http: ProviderHTTP, target: Target, items: list[tuple[str, dict[str, Any]]], tag: str
    ) -> str:
        requests = [{"custom_id": cid, "params": body} for cid, body in items]
        created = await http.send("POST", target, "/messages/batches", json={"requests": requests})
        return str(created.json()["id"])

    async def find_orphans(
        self, http: ProviderHTTP, target: Target, tag: str, n: int, since: float
    ) -> list[Candidate]:
        found: list[Candidate] = []
        pages = recent_batches(http, target, "/messages/batches", since, _created_at, "after_id")
        async for b in pages:
            total = sum(int(v or 0) for v in (b.get("request_counts") or {}).values())
            if total == n and _created_at(b) >= since - CLOCK_SKEW_S:
                found.append(Candidate(b["id"], verified=False))
        return found

    async def poll(self, http: ProviderHTTP, target: Target, batch_id: str) -> Snapshot:
        b = (await http.send("GET", target, f"/messages/batches/{batch_id}")).json()
        counts = {k: int(v or 0) for k, v in (b.get("request_counts") or {}).items()}
        total = sum(counts.values())
        # Only `processing` moves before the batch ends; the rest stay 0 until then.
        return Snapshot(
            status=str(b["processing_status"]),
            terminal=b["processing_status"] == "ended",
            total=total,
            done=total - counts.get("processing", 0),
            failed=counts.get("errored", 0) + counts.get("expired", 0) + counts.get("canceled", 0),
            raw=b,
        )

    async def results(self, http: ProviderHTTP, target: Target, snap: Snapshot) -> Results:
        batch_id = snap.raw["id"]
        url = snap.raw.get("results_url")
        prefix = target.base_url.rstrip("/")
        path = (
            url[len(prefix) :]
            if isinstance(url, str) and url.startswith(prefix)
            else f"/messages/batches/{batch_id}/results"
        )
        content = await http.send("GET", target, path, headers={"accept": "application/binary"})
        return {ln["custom_id"]: _outcome(ln, batch_id) for ln in _lines(content.content)}

    async def cancel(self, http: ProviderHTTP, target: Target, batch_id: str) -> None:
        await http.send("POST", target, f"/messages/batches/{batch_id}/cancel")

    def sdk_error_base(self) -> type[Exception] | None:
        """The anthropic SDK turns any exception from its transport into APIConnectionError
        and retries it, unless it is an AnthropicError."""
        module = sys.modules.get("anthropic")
        base = getattr(module, "AnthropicError", None)
        return base if isinstance(base, type) and issubclass(base, Exception) else None

    def dry_run_body(self, endpoint: str, body: dict[str, Any], custom_id: str) -> dict[str, Any]:
        return {
            "id": f"msg_dryrun_{custom_id}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": ""}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }


def _outcome(line: dict[str, Any], batch_id: str) -> Outcome | BatchifyError:
    result = line.get("result") or {}
    kind = result.get("type")
    headers = {"x-shoal-batch-id": batch_id}
    if kind == "succeeded":
        return json_outcome(200, result.get("message"), headers)
    where = f"batch {batch_id}, request {line.get('custom_id')}"
    if kind == "errored":
        body = result.get("error") or {}
        if body.get("request_id"):
            headers["request-id"] = str(body["request_id"])
        status = ERROR_STATUS.get(str((body.get("error") or {}).get("type")), 500)
        return json_outcome(status, body, headers)
    if kind == "expired":
        return BatchExpiredError(f"{where}: not run before the batch expired")
    if kind == "canceled":
        return BatchCancelledError(f"{where}: the batch was cancelled before it ran")
    return BatchifyError(f"{where}: unknown result type {kind!r}")
