"""Turning engine outputs into OpenAI response bodies, stream chunks and list pages.

Pure functions, independent of the web framework and the engine, so whole responses, stream
chunks and Batch API objects are built the same way in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal.outputs import RequestOutput
from shoal.tool_calls import ArgsDelta, CallStart, Event, TextDelta, ToolCall, ToolCallParser

if TYPE_CHECKING:
    from shoal.server.structured import ToolPlan


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return str(tokenizer.decode([token_id]))


def usage(outs: Sequence[RequestOutput | None], n: int) -> dict[str, Any]:
    """Token counts over all choices; a prompt shared by its `n` choices counts once.

    `outs` are prompt-major: output `i` answers prompt `i // n`.
    """
    prompts: dict[int, int] = {}
    cached: dict[int, int] = {}
    for i, o in enumerate(outs):
        if o is not None:
            prompts[i // n] = len(o.prompt_token_ids)
            cached[i // n] = o.num_cached_tokens
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(len(o.token_ids) for o in outs if o is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def completion_logprobs(
    tokenizer: Any, out: RequestOutput, start: int, end: int, text_offset: int
) -> dict[str, Any] | None:
    """The legacy completions shape for generated tokens [start, end)."""
    if out.logprobs is None or out.top_logprobs is None:
        return None
    end = min(end, len(out.logprobs))
    tokens = [_token_text(tokenizer, t) for t in out.token_ids[start:end]]
    offsets = []
    pos = text_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [
        {_token_text(tokenizer, t): lp for t, lp in alts.items()}
        for alts in out.top_logprobs[start:end]
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(out.logprobs[start:end]),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Any, out: RequestOutput, start: int, end: int
) -> dict[str, Any] | None:
    """The chat shape: one entry per generated token with its alternatives."""
    if out.logprobs is None or out.top_logprobs is None:
        return None
    content = []
    end = min(end, len(out.logprobs))
    for i in range(start, end):
        tok = _token_text(tokenizer, out.token_ids[i])
        alts = [
            {"token": (s := _token_text(tokenizer, t)), "logprob": lp, "bytes": list(s.encode())}
            for t, lp in out.top_logprobs[i].items()
        ]
        content.append(
            {
                "token": tok,
                "logprob": out.logprobs[i],
                "bytes": list(tok.encode()),
                "top_logprobs": alts,
            }
        )
    return {"content": content, "refusal": None}


def _envelope(
    rid: str, obj: str, created: int, model: str, choices: list[Any], **extra: Any
) -> dict[str, Any]:
    """What every response body and stream chunk starts with."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
        "system_fingerprint": None,
    }


def completion_body(
    rid: str, created: int, model: str, outs: Sequence[RequestOutput], n: int, tokenizer: Any
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": o.text,
            "logprobs": completion_logprobs(tokenizer, o, 0, len(o.token_ids), 0),
            "finish_reason": o.finish_reason,
        }
        for i, o in enumerate(outs)
    ]
    return _envelope(rid, "text_completion", created, model, choices, usage=usage(outs, n))


def tool_finish(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """An answer that ended on its own after making calls finished to have them run."""
    made = any(c.complete for c in calls)
    return "tool_calls" if made and finish_reason == "stop" else finish_reason


def chat_message(out: RequestOutput, tools: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole answer, and its finish reason. A call that
    `max_tokens` cut short is kept with its arguments as far as they got, which the finish
    reason `length` marks incomplete. A forced tool choice answers calls only."""
    if tools is None:
        return {"role": "assistant", "content": out.text, "refusal": None}, out.finish_reason
    reader = tools.parser()
    reader.feed(out.text)
    reader.finish()
    calls = reader.calls
    content = reader.text if reader.text or not (calls or tools.forced) else None
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return message, tool_finish(out.finish_reason, calls)


def chat_delta(
    reader: ToolCallParser | None, text: str, out: RequestOutput
) -> tuple[dict[str, Any], str | None]:
    """A stream chunk's delta for newly released `text` (and the finish reason when `out`
    is finished): content, and `tool_calls` entries (id and name first, then arguments)."""
    if reader is None:
        return ({"content": text} if text else {}), out.finish_reason
    events: list[Event] = reader.feed(text)
    if out.finished:
        events += reader.finish()
    delta: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, TextDelta):
            delta["content"] = delta.get("content", "") + e.text
        elif isinstance(e, CallStart):
            fn = {"name": e.name, "arguments": ""}
            calls[e.index] = {"index": e.index, "id": e.id, "type": "function", "function": fn}
        elif isinstance(e, ArgsDelta):
            entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta, tool_finish(out.finish_reason, reader.calls) if out.finished else None


def chat_body(
    rid: str,
    created: int,
    model: str,
    outs: Sequence[RequestOutput],
    n: int,
    tokenizer: Any,
    tools: ToolPlan | None = None,
) -> dict[str, Any]:
    choices = []
    for i, o in enumerate(outs):
        message, finish_reason = chat_message(o, tools)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(tokenizer, o, 0, len(o.token_ids)),
                "finish_reason": finish_reason,
            }
        )
    return _envelope(rid, "chat.completion", created, model, choices, usage=usage(outs, n))


def _chunk(
    rid: str, obj: str, created: int, model: str, choice: dict[str, Any], with_usage: bool
) -> dict[str, Any]:
    chunk = _envelope(rid, obj, created, model, [choice])
    if with_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    rid: str, created: int, model: str, choice: dict[str, Any], with_usage: bool
) -> dict[str, Any]:
    return _chunk(rid, "text_completion", created, model, choice, with_usage)


def chat_chunk(
    rid: str, created: int, model: str, choice: dict[str, Any], with_usage: bool
) -> dict[str, Any]:
    return _chunk(rid, "chat.completion.chunk", created, model, choice, with_usage)


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of a paginated list (`/v1/files`, `/v1/batches`)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def batch_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A Batch API object's `usage`."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }
