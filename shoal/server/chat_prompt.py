"""A chat request's messages as prompt token ids, through the model's chat template.

Text content parts are joined; an assistant message's `tool_calls` keep their ids and get
their `arguments` parsed (a JSON object, or a 400); a `tool` message must answer a call made
earlier in the conversation (by `tool_call_id`). Tools and tool turns are presented by
`shoal.tool_calls.render`: natively where the template renders tools, else in the fallback
prompt. Runs in a worker thread: templating and tokenizing can take a while.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shoal.engine.protocol import EngineProtocol
from shoal.errors import InvalidRequestError, PromptTooLongError
from shoal.server.errors import APIError
from shoal.server.protocol import ChatCompletionRequest, ChatMessage
from shoal.server.structured import ToolPlan
from shoal.tool_calls import dialect_for, render


def _text(m: ChatMessage, i: int) -> str:
    if not isinstance(m.content, list):
        return m.content or ""
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400, f"unsupported content part type {part.type!r}", param=f"messages.{i}.content"
            )
        texts.append(part.text)
    return "".join(texts)


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation in the shape chat templates take (raises APIError)."""
    messages: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # id -> function name, of the calls made so far
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": _text(m, i)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(
                    400, "only assistant messages carry tool_calls", param=f"messages.{i}"
                )
            msg["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                where = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise APIError(400, f"{where} is not a JSON object", param=where)
                fn = {"name": call.function.name, "arguments": arguments}
                msg["tool_calls"].append({"id": call.id, "type": "function", "function": fn})
                calls[call.id] = call.function.name
        if m.role == "tool":
            where = f"messages.{i}.tool_call_id"
            if m.tool_call_id not in calls:
                raise APIError(
                    400,
                    f"{where}: {m.tool_call_id!r} answers no tool call made earlier"
                    if m.tool_call_id
                    else f"{where}: a tool message needs the id of the call it answers",
                    param=where,
                )
            msg["tool_call_id"] = m.tool_call_id
            msg["name"] = calls[m.tool_call_id]
        messages.append(msg)
    return messages


def template_input(
    engine: EngineProtocol, req: ChatCompletionRequest, plan: ToolPlan | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the chat template takes them (raises APIError)."""
    messages = template_messages(req)
    tools: list[dict[str, Any]] | None = None
    if plan is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        template = getattr(engine.tokenizer, "chat_template", None)
        dialect, native = (plan.dialect, plan.native) if plan else dialect_for(template)
        messages, tools = render(messages, list(plan.tools) if plan else [], dialect, native)
    return messages, tools


@contextmanager
def template_errors() -> Iterator[None]:
    """Templating and tokenizing errors as the 400s a client can act on."""
    try:
        yield
    except PromptTooLongError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from e
    except InvalidRequestError as e:  # no tokenizer or no chat template
        raise APIError(400, f"{e}: use /v1/completions") from e
    except APIError:
        raise
    except Exception as e:  # the template itself rejected the conversation
        raise APIError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from e


def chat_prompt(
    engine: EngineProtocol,
    req: ChatCompletionRequest,
    plan: ToolPlan | None,
    *,
    check_length: bool = True,
) -> list[int]:
    """The prompt's ids; `check_length=False` takes one of any length (to count it)."""
    messages, tools = template_input(engine, req, plan)
    with template_errors():
        return engine.apply_chat_template(messages, tools, check_length=check_length)
