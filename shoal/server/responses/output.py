"""The `Response` object: what the request asked for, echoed, around the answer's output items,
its status and usage (shaped like the `openai` SDK's `Response`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from shoal.outputs import RequestOutput
from shoal.server.responses.items import Tools
from shoal.server.responses.protocol import NamedFunction, ResponseCreateRequest


def status_of(finish_reason: str | None) -> str:
    """A finished answer's response status (an aborted one never gets here: it failed)."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage(out: RequestOutput, kept: bool) -> dict[str, Any]:
    """Token counts; `cached_tokens` is the engine's own count of prompt tokens whose KV it
    reused. With `kept` (a chain's session keeps this turn's KV), the computed prompt tokens
    are the ones written to the cache."""
    prompt = len(out.prompt_token_ids)
    cached = out.num_cached_tokens
    completion = len(out.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": prompt - cached if kept else 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


@dataclass(slots=True)
class Frame:
    """Everything of a response object but its outcome: fixed when the request arrives."""

    id: str
    created_at: int
    model: str
    req: ResponseCreateRequest
    tools: Tools

    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None else None
        choice = req.tool_choice or "auto"
        if isinstance(choice, NamedFunction):
            choice = choice.model_dump()
        finished = status in ("completed", "incomplete", "failed", "cancelled")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": bool(req.background),
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output or [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            "tool_choice": choice,
            "tools": self.tools.echo,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage if finished else None,
            "user": req.user,
        }
