"""What a chat request's answer must be: `response_format`, `tools`, `tool_choice` and
`parallel_tool_calls` become the engine's `StructuredOutput` and a `ToolPlan` that reads
calls back out of the answer.

- `response_format` `json_object` / `json_schema`: the answer is constrained to JSON (to the
  schema). `strict` is accepted either way: shoal always constrains, so the answer always
  validates, or ends with finish reason `length` when `max_tokens` runs out first.
- `tool_choice` `required` or a named function: the grammar admits only calls (one call of
  that function), each one's arguments valid against its schema; with `required`,
  `parallel_tool_calls=false` admits one. `auto` (the default with tools) leaves the model
  free and parses its answer leniently; with a JSON `response_format` too, the answer is
  either calls or that JSON. `none` presents no tools and parses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.sampling_params import StructuredOutput
from shoal.server.errors import APIError
from shoal.server.ids import new_id
from shoal.server.protocol import ChatCompletionRequest, NamedToolChoice, ResponseFormat
from shoal.tool_calls import (
    FunctionTool,
    ToolCallParser,
    ToolDialect,
    calls_format,
    dialect_for,
    structural_tag,
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The tools a request offers and how its answer is read."""

    dialect: ToolDialect
    native: bool  # the chat template renders the tools itself
    tools: tuple[FunctionTool, ...]
    forced: bool  # the grammar admits only calls
    parallel: bool
    id_prefix: str = "call_"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(
            self.dialect,
            {t.name for t in self.tools},
            lambda: new_id(self.id_prefix),
            stream_arguments=self.forced,
            max_calls=None if self.parallel else 1,
        )


def _json_answer(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400, "response_format json_schema needs a json_schema", param="response_format"
            )
        if fmt.json_schema.schema_ is not None:
            return fmt.json_schema.schema_
    return {"type": "object"}


def _tools(req: ChatCompletionRequest) -> list[FunctionTool]:
    tools = [
        FunctionTool(t.function.name, t.function.description, t.function.parameters)
        for t in req.tools or []
    ]
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise APIError(400, f"two tools are named {tool.name!r}", param=f"tools.{i}")
        seen.add(tool.name)
    return tools


def plan_answer(
    req: ChatCompletionRequest, chat_template: str | None
) -> tuple[ToolPlan | None, StructuredOutput | None]:
    """(how to read tool calls, or None; the engine's constraint, or None). Raises APIError."""
    schema = _json_answer(req.response_format)
    tools = _tools(req)
    choice = req.tool_choice
    if choice is not None and not tools:
        raise APIError(400, "tool_choice is only allowed with tools", param="tool_choice")
    json_only = None
    if schema is not None:
        json_only = (
            StructuredOutput(json_object=True)
            if schema == {"type": "object"}
            else StructuredOutput(json=schema)
        )
    if not tools or choice == "none":
        return None, json_only
    dialect, native = dialect_for(chat_template)
    parallel = req.parallel_tool_calls is not False
    forced: list[FunctionTool] | None = None
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t.name == choice.function.name]
        if not forced:
            raise APIError(
                400,
                f"tool_choice names the function {choice.function.name!r}, "
                "which is not among the tools",
                param="tool_choice",
            )
    elif choice == "required":
        forced = tools
    plan = ToolPlan(dialect, native, tuple(tools), forced is not None, parallel)
    if forced is not None:  # a named function is called once
        fmt = calls_format(dialect, forced, parallel and choice == "required")
    elif schema is not None:
        answer = {"type": "json_schema", "json_schema": schema}
        fmt = {"type": "or", "elements": [answer, calls_format(dialect, tools, parallel)]}
    else:
        return plan, None
    return plan, StructuredOutput(structural_tag=structural_tag(fmt))
