"""Anthropic shapes: messages, stream events, message batches, result lines, errors.

Pure functions over the OpenAI-shaped objects the shared serving path and batch runner
produce, so both APIs keep one engine path and one batch store.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

# Finish reasons; a stop sequence also ends as "stop", so it reads as end_turn.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_ENDED = ("completed", "failed", "expired", "cancelled")
_NOT_RUN = {"batch_expired": "expired", "batch_cancelled": "canceled"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(finish_reason: str | None) -> str:
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def message(
    rid: str,
    model: str,
    content: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish_reason),
        "stop_sequence": None,
        "usage": usage,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's `input`: its arguments, or of a call `max_tokens` cut short, what of them is
    complete (read as the SDKs read a streamed call's `input_json_delta`s, by jiter)."""
    import jiter

    try:
        value = jiter.from_json(arguments.encode(), partial_mode=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any], forced: bool = False) -> list[dict[str, Any]]:
    """An OpenAI assistant message as Anthropic content blocks: text, then tool_use. A forced
    tool choice answers tool_use blocks only (none, if `max_tokens` left no call)."""
    blocks: list[dict[str, Any]] = []
    if message.get("content") or not (message.get("tool_calls") or forced):
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for call in message.get("tool_calls") or []:
        arguments = tool_input(call["function"]["arguments"])
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": arguments,
            }
        )
    return blocks


def message_from_chat(rid: str, chat: dict[str, Any], forced: bool = False) -> dict[str, Any]:
    choice, usage = chat["choices"][0], chat["usage"]
    return message(
        rid,
        chat["model"],
        content_blocks(choice["message"], forced),
        choice["finish_reason"],
        {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    )


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def rfc3339(ts: int | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def message_batch(obj: dict[str, Any], results_url: str) -> dict[str, Any]:
    """A message batch from the runner's batch object (counts already live)."""
    status = obj["status"]
    ended = status in _ENDED
    counts = obj.get("request_counts") or {}
    total, ok, failed = counts.get("total", 0), counts.get("completed", 0), counts.get("failed", 0)
    rest = max(0, total - ok - failed)
    return {
        "id": obj["id"],
        "type": "message_batch",
        "processing_status": "ended"
        if ended
        else "canceling"
        if status == "cancelling"
        else "in_progress",
        "request_counts": {
            "processing": 0 if ended else rest,
            "succeeded": ok,
            "errored": failed + (rest if ended and status == "failed" else 0),
            "canceled": rest if status == "cancelled" else 0,
            "expired": rest if status == "expired" else 0,
        },
        "created_at": rfc3339(obj["created_at"]),
        "expires_at": rfc3339(obj["expires_at"]),
        "ended_at": rfc3339(next((obj[f"{s}_at"] for s in _ENDED if obj.get(f"{s}_at")), None)),
        "cancel_initiated_at": rfc3339(obj.get("cancelling_at")),
        "archived_at": None,
        "results_url": results_url if ended else None,
    }


def result_line(line: dict[str, Any]) -> dict[str, Any]:
    """One results JSONL line from a runner output or error line."""
    response, error = line.get("response"), line.get("error") or {}
    if response is None:
        result: dict[str, Any] = {"type": _NOT_RUN.get(str(error.get("code")), "expired")}
    elif response["status_code"] == 200:
        result = {"type": "succeeded", "message": response["body"]}
    else:
        result = {"type": "errored", "error": response["body"]}
    return {"custom_id": line["custom_id"], "result": result}
