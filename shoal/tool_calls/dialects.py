"""How a model writes a tool call, and the grammar that forces one.

A dialect is the text around one call's JSON object, `{"name": ..., "<args key>": {...}}`:
- `hermes`: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, what Qwen2.5 and
  Qwen3 templates render and parse (and shoal's fallback for templates without tools);
- `llama3_json`: a bare `{"name": "f", "parameters": {...}}`, Llama 3.1's JSON tool calls.

`dialect_for(template)` picks the one a chat template speaks, and whether it renders tools
itself (`native`); a template that knows no tools gets shoal's fallback prompt (`prompt.py`)
in the hermes dialect. `calls_format` is the xgrammar structural tag under which the model can
only write calls, each one's arguments valid against its tool's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool the model may call: a name and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """Arguments are always a JSON object; a tool without a schema takes any object."""
        return self.parameters if self.parameters else {"type": "object"}

    def as_openai(self) -> dict[str, Any]:
        """The shape chat templates take (`tools=[...]`)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolDialect:
    name: str
    prefix: str  # text before the call's JSON object
    suffix: str  # text after it
    args_key: str
    separator: str  # between two calls

    @property
    def trigger(self) -> str:
        """What starts a call in the output text."""
        return self.prefix.strip() or '{"name"'

    def head(self, name: str) -> str:
        """A call's text up to its arguments."""
        return f'{self.prefix}{{"name": {json.dumps(name)}, "{self.args_key}": '

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return f"{self.head(name)}{json.dumps(arguments)}}}{self.suffix}"


HERMES = ToolDialect("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3_JSON = ToolDialect("llama3_json", "", "", "parameters", "\n")


def dialect_for(chat_template: str | None) -> tuple[ToolDialect, bool]:
    """(the dialect, whether the template renders `tools` itself in it)."""
    template = chat_template or ""
    if "tools" in template and "<tool_call>" in template:
        return HERMES, True
    if "tools" in template and '"parameters"' in template:
        return LLAMA3_JSON, True
    return HERMES, False


def calls_format(dialect: ToolDialect, tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """A structural-tag format that matches one call (or, with `parallel`, several) to `tools`
    and nothing else."""
    tags = [
        {
            "type": "tag",
            "begin": dialect.head(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.schema},
            "end": "}" + dialect.suffix,
        }
        for tool in tools
    ]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": dialect.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    """The structural tag around a format, as `StructuredOutput(structural_tag=...)` takes it."""
    return {"type": "structural_tag", "format": fmt}
