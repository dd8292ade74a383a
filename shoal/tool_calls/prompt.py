"""A conversation with tools, as a chat template takes it.

Messages come in the OpenAI shape chat templates know: an assistant turn may carry
`tool_calls` (`{"id", "type": "function", "function": {"name", "arguments": {...}}}`, arguments
as a dict) and a `tool` message answers one by `tool_call_id`. A template that renders tools
itself (`native`) gets them as they are, plus `tools=[...]`. Any other template gets the
fallback, plain text in the hermes dialect that any chat model can read:

- the tools and how to call them go into the system message (`FALLBACK_PROMPT`);
- an assistant turn's calls become `<tool_call>` blocks after its text;
- tool results become a user turn of `<tool_response>` blocks (consecutive results share one),
  since many templates accept only system, user and assistant roles.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.tool_calls.dialects import FunctionTool, ToolDialect

FALLBACK_PROMPT = """You can call these tools. Each line is one tool's name, description \
and the JSON schema of its arguments:
{tools}

To call a tool, answer with one block per call, and nothing else:
<tool_call>
{{"name": "<tool name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
Each result comes back in a <tool_response> block. Without a tool to call, answer normally."""


def fallback_system_prompt(tools: list[FunctionTool]) -> str:
    lines = [
        json.dumps({"name": t.name, "description": t.description or "", "parameters": t.schema})
        for t in tools
    ]
    return FALLBACK_PROMPT.format(tools="\n".join(lines))


def _calls_as_text(dialect: ToolDialect, message: dict[str, Any]) -> str:
    calls = [
        dialect.call_text(c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls") or []
    ]
    text = str(message.get("content") or "")
    return dialect.separator.join([text, *calls] if text else calls)


def render(
    messages: list[dict[str, Any]],
    tools: list[FunctionTool],
    dialect: ToolDialect,
    native: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template`; `tools` is None where the prompt already
    holds them (the fallback) or there are none."""
    if native:
        return messages, [t.as_openai() for t in tools] or None
    out: list[dict[str, Any]] = []
    if tools:
        system = fallback_system_prompt(tools)
        if messages and messages[0]["role"] in ("system", "developer"):
            first, *messages = messages
            system = f"{first.get('content') or ''}\n\n{system}".lstrip()
        out.append({"role": "system", "content": system})
    in_results = False  # the last message out is a user turn of tool results
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if in_results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            in_results = True
            continue
        in_results = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _calls_as_text(dialect, m)})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    return out, None
