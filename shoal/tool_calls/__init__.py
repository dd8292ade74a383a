"""Tool calling without torch: the dialects models write calls in (`dialects`), prompts that
present tools to a chat template (`prompt`), and the parser that reads calls back (`parser`).

The servers (OpenAI and Anthropic APIs) use these; the engine only ever sees the structured
output a forced call compiles to.
"""

from shoal.tool_calls.dialects import (
    HERMES,
    LLAMA3_JSON,
    FunctionTool,
    ToolDialect,
    calls_format,
    dialect_for,
    structural_tag,
)
from shoal.tool_calls.parser import (
    ArgsDelta,
    CallEnd,
    CallStart,
    Event,
    TextDelta,
    ToolCall,
    ToolCallParser,
    parse,
)
from shoal.tool_calls.prompt import render

__all__ = [
    "HERMES",
    "LLAMA3_JSON",
    "ArgsDelta",
    "CallEnd",
    "CallStart",
    "Event",
    "FunctionTool",
    "TextDelta",
    "ToolCall",
    "ToolCallParser",
    "ToolDialect",
    "calls_format",
    "dialect_for",
    "parse",
    "render",
    "structural_tag",
]
