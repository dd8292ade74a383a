"""Responses API items and tools in the chat-completions shape the shared path takes.

- `normalize` gives each input item the stored shape (`GET .../input_items` lists it) and an
  id: a string input is one user message, content parts keep their types, reasoning items are
  carried as they came.
- `chat_messages` turns items (inputs, and earlier responses' outputs) into chat messages: a
  `function_call` joins the assistant message it follows as a tool call (a run of calls is one
  message), a `function_call_output` becomes a `tool` message, `developer` is `system`, and
  reasoning items are not shown to the model.
- `function_tools` keeps the function tools (those inside a `namespace` too, which Codex
  sends) and drops the tool types shoal cannot run (web search, image generation, shells,
  ...), naming them so the route can warn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from shoal.server.errors import APIError
from shoal.server.ids import new_id
from shoal.server.protocol import ChatCompletionRequest
from shoal.server.responses.protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunction,
    TextConfig,
)

_TEXT_PARTS = ("input_text", "output_text", "text")


def _parts(content: str | list[ContentPart], role: str, where: str) -> list[dict[str, Any]]:
    out_type = "output_text" if role == "assistant" else "input_text"
    parts = [ContentPart(type=out_type, text=content)] if isinstance(content, str) else content
    result: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if part.type == "refusal" and role == "assistant":
            result.append({"type": "refusal", "refusal": part.refusal or part.text or ""})
        elif part.type in _TEXT_PARTS and part.text is not None:
            entry: dict[str, Any] = {"type": out_type, "text": part.text}
            if out_type == "output_text":
                entry["annotations"] = []
            result.append(entry)
        else:
            raise APIError(
                400,
                f"{where}.content.{j}: content parts of type {part.type!r} are not supported "
                "(only text)",
                param=f"{where}.content.{j}",
            )
    return result


def normalize(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """This request's input as stored items, each with an id."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            out.append(
                {
                    "id": item.id or new_id("msg_"),
                    "type": "message",
                    "role": item.role,
                    "status": "completed",
                    "content": _parts(item.content, item.role, where),
                }
            )
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.id or new_id("fc_"),
                "type": "function_call",
                "call_id": item.call_id,
                "name": item.name,
                "arguments": item.arguments,
                "status": "completed",
            }
            if item.namespace:
                call["namespace"] = item.namespace
            out.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            if not isinstance(output, str):
                output = "".join(p["text"] for p in _parts(output, "tool", where))
            out.append(
                {
                    "id": item.id or new_id("fco_"),
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": output,
                    "status": "completed",
                }
            )
        else:  # reasoning
            carried = item.model_dump(exclude_none=True, by_alias=True)
            carried["id"] = item.id or new_id("rs_")
            out.append(carried)
    return out


def _text(item: dict[str, Any]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in item.get("content") or [])


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items (inputs and outputs, in order) as chat-completions messages."""
    messages: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant turn that later calls may join
    for item in items:
        kind = item.get("type")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item)})
            joinable = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not joinable:
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            joinable = True
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
            joinable = False
    return messages


@dataclass(slots=True)
class Tools:
    """The tools of a request as the chat path takes them, and what was dropped."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    echo: list[dict[str, Any]] = field(default_factory=list)  # the request's, less the dropped
    dropped: list[str] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def function_tools(raw: list[dict[str, Any]] | None) -> Tools:
    tools = Tools()
    for tool in raw or []:
        kind = str(tool.get("type"))
        if kind == "function":
            tools.chat.append(_function(tool))
            tools.echo.append(tool)
        elif kind == "namespace":
            inner = [t for t in tool.get("tools") or [] if t.get("type") == "function"]
            for t in inner:
                tools.chat.append(_function(t))
                tools.namespaces[str(t.get("name"))] = str(tool.get("name"))
            tools.echo.append({**tool, "tools": inner})
        else:
            tools.dropped.append(kind)
    return tools


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    if choice.get("type") == "function":
        raise APIError(400, "tool_choice of type 'function' needs a name", param="tool_choice")
    raise APIError(
        400,
        f"tool_choice of type {choice.get('type')!r} is not supported: use none, auto, "
        "required or a function",
        param="tool_choice",
    )


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format`."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or not fmt.name:
        raise APIError(
            400, "text.format json_schema needs a name and a schema", param="text.format"
        )
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    if fmt.description:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


def to_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request for a body built from a Responses request (raises APIError)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise APIError(400, f"{where}: {first['msg']}", param=where) from e
