"""Answers with tools, whole and streamed, from engine outputs (no model): with `auto` the
dialect's markup never reaches the content, a call `max_tokens` cut short is a call marked by
finish reason `length`, and a streamed answer says what the whole one says."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.outputs import RequestOutput
from shoal.server.anthropic.formatting import content_blocks
from shoal.server.formatting import chat_delta, chat_message
from shoal.server.structured import ToolPlan
from shoal.tool_calls import HERMES, FunctionTool

TOOLS = (FunctionTool("add"), FunctionTool("city"))
AUTO = ToolPlan(HERMES, False, TOOLS, (), True)
ADD = HERMES.call_text("add", {"a": 1, "note": "x"})
CUT = ADD[:-25]  # inside the arguments: '{"a": 1, "'


def _out(text: str, finish: str | None) -> RequestOutput:
    return RequestOutput("r", None, [1], text, [7] * len(text), finish)


@pytest.mark.parametrize(
    ("text", "finish", "content", "calls"),
    [
        ("Sure. <tool_call> not json </tool_call> Done.", "stop", "Sure. Done.", []),
        ("stray </tool_call> tag", "stop", "stray tag", []),
        ("I will call <tool_ca", "length", "I will call", []),
        (
            f"Here.\n{CUT}",
            "length",
            "Here.",
            [("add", CUT.removeprefix(HERMES.head("add")), "length")],
        ),
        (f"{ADD}\n{HERMES.call_text('nope', {})}", "stop", None, [("add", None, "tool_calls")]),
    ],
)
def test_auto_answers_never_show_markup(
    text: str, finish: str, content: str | None, calls: list[tuple[str, str | None, str]]
) -> None:
    message, reason = chat_message(_out(text, finish), AUTO)
    assert message["content"] == content
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    assert [n for n, _ in got] == [n for n, *_ in calls]
    for (_, arguments), (_, expected, want_reason) in zip(got, calls, strict=True):
        assert expected is None or arguments == expected
        assert reason == want_reason
    # streamed a character at a time: the same content and calls
    reader = AUTO.parser()
    streamed_content, streamed_args = "", ""
    for i in range(len(text)):
        done = i == len(text) - 1
        delta, _ = chat_delta(reader, text[i], _out(text[: i + 1], finish if done else None))
        streamed_content += delta.get("content", "")
        streamed_args += "".join(t["function"]["arguments"] for t in delta.get("tool_calls", []))
    assert streamed_content == (content or "")
    assert streamed_args == "".join(a for _, a in got)


def test_forced_answers_hold_calls_only() -> None:
    forced = ToolPlan(HERMES, False, TOOLS, ("add", "city"), True)
    message, reason = chat_message(_out("<tool_", "length"), forced)  # no name reached
    assert (message["content"], message.get("tool_calls"), reason) == (None, None, "length")
    assert content_blocks(message, forced=True) == []  # no text block
    message, _ = chat_message(_out(CUT, "length"), forced)
    (block,) = content_blocks(message, forced=True)
    assert block["type"] == "tool_use" and block["input"] == {"a": 1}  # what is complete


def test_tool_input_of_a_complete_call_is_its_arguments() -> None:
    message: dict[str, Any] = {
        "content": None,
        "tool_calls": [{"id": "t", "function": {"name": "add", "arguments": '{"a": [1, 2.5]}'}}],
    }
    assert content_blocks(message)[0]["input"] == {"a": [1, 2.5]}
