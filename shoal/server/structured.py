"""What a chat request's answer must be: `response_format`, `tools`, `tool_choice` and
`parallel_tool_calls` become the engine's `StructuredOutput` and a `ToolPlan` that reads
calls back out of the answer.

- `response_format` `json_object` / `json_schema`: the answer is constrained to JSON (to the
  schema), or ends with finish reason `length` when `max_tokens` runs out first.
- `tool_choice` `required` or a named function: the grammar admits only calls (one call of
  that function), each one's arguments valid against its schema; with `required`,
  `parallel_tool_calls=false` admits one. `auto` (the default with tools) leaves the model
  free and parses its answer leniently; with a JSON `response_format` too, the answer is
  either calls or that JSON. `none` presents no tools and parses nothing.

Every schema (the answer's, each tool's parameters) is checked before anything compiles it
(`schema_check`, `schema_matchable`): within the limits, matchable, a tool's an object; with
`strict: true`, only keywords the grammar enforces. A refusal is a `SchemaRefusal` naming the
schema's place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from shoal.engine.protocol import EngineProtocol
from shoal.errors import InvalidRequestError
from shoal.sampling_params import StructuredOutput
from shoal.server.errors import APIError
from shoal.server.ids import new_id
from shoal.server.protocol import ChatCompletionRequest, NamedToolChoice, ResponseFormat
from shoal.server.schema_check import (
    SchemaLimits,
    SchemaRefusal,
    check_arguments_schema,
    check_limits,
    check_strict,
)
from shoal.server.schema_matchable import check_matchable
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
    forced: tuple[str, ...]  # the tools the grammar admits calls to, and nothing else; () if free
    parallel: bool
    id_prefix: str = "call_"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(
            self.dialect,
            set(self.forced or (t.name for t in self.tools)),
            lambda: new_id(self.id_prefix),
            forced=bool(self.forced),
            max_calls=None if self.parallel else 1,
        )


def checked(
    schema: dict[str, Any], limits: SchemaLimits, *, strict: bool, where: str, param: str
) -> dict[str, Any]:
    """`schema`, if it is within `limits`, matchable and (`strict`) enforceable; raises
    `SchemaRefusal` naming `where` (the schema's place in the request) and `param`."""
    try:
        check_limits(schema, limits)
        check_matchable(schema)
        if strict:
            check_strict(schema)
    except SchemaRefusal as e:
        raise SchemaRefusal(f"{where}: {e}", e.reason, param) from None
    return schema


def _json_answer(fmt: ResponseFormat | None, limits: SchemaLimits) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400, "response_format json_schema needs a json_schema", param="response_format"
            )
        if fmt.json_schema.schema_ is not None:
            where = "response_format.json_schema.schema"
            strict = bool(fmt.json_schema.strict)
            return checked(
                fmt.json_schema.schema_, limits, strict=strict, where=where, param="response_format"
            )
    return {"type": "object"}


def _tools(req: ChatCompletionRequest, limits: SchemaLimits, schema_at: str) -> list[FunctionTool]:
    tools = []
    seen: set[str] = set()
    for i, t in enumerate(req.tools or []):
        fn = t.function
        if fn.name in seen:
            raise APIError(400, f"two tools are named {fn.name!r}", param=f"tools.{i}")
        seen.add(fn.name)
        where = schema_at.format(i)
        try:
            check_arguments_schema(fn.parameters)
        except SchemaRefusal as e:
            raise SchemaRefusal(f"{where}: {e}", e.reason, where) from None
        if fn.parameters:
            checked(fn.parameters, limits, strict=bool(fn.strict), where=where, param=where)
        tools.append(FunctionTool(fn.name, fn.description, fn.parameters))
    return tools


def plan_answer(
    req: ChatCompletionRequest,
    chat_template: str | None,
    limits: SchemaLimits | None = None,
    tool_schema_at: str = "tools.{}.function.parameters",
) -> tuple[ToolPlan | None, StructuredOutput | None]:
    """(how to read tool calls, or None; the engine's constraint, or None). Raises APIError,
    or `SchemaRefusal` for a schema it will not compile (`tool_schema_at` names a tool's
    schema in the request's own API)."""
    limits = limits or SchemaLimits()
    schema = _json_answer(req.response_format, limits)
    tools = _tools(req, limits, tool_schema_at)
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
    names = tuple(t.name for t in forced) if forced is not None else ()
    plan = ToolPlan(dialect, native, tuple(tools), names, parallel)
    if forced is not None:  # a named function is called once
        fmt = calls_format(dialect, forced, parallel and choice == "required")
    elif schema is not None:
        answer = {"type": "json_schema", "json_schema": schema}
        fmt = {"type": "or", "elements": [answer, calls_format(dialect, tools, parallel)]}
    else:
        return plan, None
    return plan, StructuredOutput(structural_tag=structural_tag(fmt))


async def compiled(engine: EngineProtocol, spec: StructuredOutput, plan: ToolPlan | None) -> Any:
    """The compiled grammar of `spec`, awaited without holding a thread: the engine compiles
    it on its own workers, within its budget; this request waits `grammar_wait_s` at most
    (then a 429). A spec that does not compile, or costs more than the budget, is a
    `SchemaRefusal`; a full compile queue (`QueueFullError`) is a 429 as it is."""
    param = "tools" if plan is not None and plan.forced else "response_format"
    wait_s = engine.config.grammar_wait_s
    try:
        future = asyncio.wrap_future(engine.compile_structured(spec))
        # shielded: the future is shared with identical requests, which must not lose it
        return await asyncio.wait_for(asyncio.shield(future), wait_s)
    except TimeoutError:
        raise APIError(
            429,
            f"{param}: the constraint did not compile within {wait_s:g} s (the grammar "
            "compile queue is busy); retry later",
            param=param,
            code="grammar_queue_busy",
            headers={"Retry-After": "5"},
        ) from None
    except InvalidRequestError as e:
        raise SchemaRefusal(f"{param}: {e}", "compile", param) from e
