"""Anthropic's tool use in the OpenAI chat shape the shared path takes, and back.

In: `tools` (client tools: name, description, input_schema, strict) become function tools;
`tool_choice` auto / any / tool / none become auto / required / a named function / none, and
`disable_parallel_tool_use` becomes `parallel_tool_calls=false`. An assistant turn's
`tool_use` blocks become its `tool_calls`; a user turn's `tool_result` blocks become `tool`
messages (before the turn's text), each answering a `tool_use` made earlier, or a 400.
(The way out, `tool_calls` to `tool_use` blocks, is in `formatting`.)
"""

from __future__ import annotations

import json
from typing import Any

from shoal.server.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
)
from shoal.server.errors import APIError

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def tool_fields(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat request's `tools`, `tool_choice` and `parallel_tool_calls`."""
    out: dict[str, Any] = {}
    if req.tools:
        for i, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise APIError(
                    400, f"tools.{i}: server tools ({tool.type}) are not supported", param="tools"
                )
            if tool.input_schema is None:
                raise APIError(400, f"tools.{i}.input_schema: Field required", param="tools")
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                    "strict": t.strict,
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if not req.tools:
            raise APIError(400, "tool_choice: there are no tools", param="tool_choice")
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice.name: a tool choice names the tool")
            if choice.name not in {t.name for t in req.tools}:
                raise APIError(400, f"tool_choice.name: {choice.name!r} is not among the tools")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = _CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def _result_text(block: ContentBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise APIError(400, f"{where}.content.{j}: only text tool results are supported")
            parts.append(part.text or "")
        text = "".join(parts)
    return f"Error: {text}" if block.is_error else text


def chat_messages(messages: list[MessageParam]) -> list[dict[str, Any]]:
    """The conversation as chat messages (raises APIError for what cannot be honoured)."""
    out: list[dict[str, Any]] = []
    made: set[str] = set()  # tool_use ids so far
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise APIError(400, f"{where}: a tool_use block needs an id and a name")
                made.add(b.id)
                arguments = json.dumps(b.input or {})
                fn = {"name": b.name, "arguments": arguments}
                calls.append({"id": b.id, "type": "function", "function": fn})
            elif b.type == "tool_result" and m.role == "user":
                if b.tool_use_id not in made:
                    raise APIError(
                        400,
                        f"{where}: tool_result for tool_use_id {b.tool_use_id!r}, "
                        "which no earlier tool_use block has",
                    )
                text = _result_text(b, where)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
            else:
                raise APIError(
                    400, f"{where}: content blocks of type {b.type!r} are not supported here"
                )
        if texts or calls or not out or out[-1]["role"] != "tool":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out
