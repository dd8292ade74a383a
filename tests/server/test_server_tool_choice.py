"""A forced tool choice answers tool calls only, whatever `max_tokens` cuts: a call cut short
comes back as a call with its arguments as far as they got and finish reason `length` /
stop reason `max_tokens`, never as the dialect's markup in text, streamed or not. Through the
unmodified `openai` and `anthropic` SDKs and raw HTTP, on the tiny random model (only the
grammar makes it call)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_harness import LiveServer, wait_pool_whole

ADD_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["a", "note"],
    "additionalProperties": False,
}
ADD = {"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}
CITY = {
    "type": "function",
    "function": {
        "name": "city",
        "parameters": {"type": "object", "properties": {"c": {"enum": ["Lima", "Oslo"]}}},
    },
}
ASK = [{"role": "user", "content": "Add 2 and 3."}]
MARKUP = ("<tool", "</tool", '{"name"')
CUTS = (1, 3, 9, 20)  # inside the tag, the name, the arguments


@pytest.fixture(scope="module")
def client(tools_server: LiveServer) -> openai.OpenAI:
    return tools_server.client()


@pytest.fixture(scope="module")
def claude(tools_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tools_server.url, api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, server: LiveServer, max_tokens: int, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=server.model, messages=ASK, temperature=0, max_tokens=max_tokens, **kw
    )


def _sse_chunks(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_openai_named_tool_cut_anywhere_is_a_call(
    client: openai.OpenAI, tools_server: LiveServer
) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    whole = _chat(client, tools_server, 160, tools=[ADD, CITY], tool_choice=named).choices[0]
    assert whole.finish_reason == "tool_calls"
    (full,) = whole.message.tool_calls or []
    for cut in CUTS:
        kw = {"tools": [ADD, CITY], "tool_choice": named}
        choice = _chat(client, tools_server, cut, **kw).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, cut
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "add" and call.id.startswith("call_")
        assert full.function.arguments.startswith(call.function.arguments), cut
        # streamed: the same call in pieces, and no text
        body = {"model": tools_server.model, "messages": ASK, "temperature": 0, "max_tokens": cut}
        chunks = _sse_chunks(tools_server, {**body, **kw})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert not any(d.get("content") for d in deltas), cut
        pieces = [t for d in deltas for t in d.get("tool_calls") or []]
        assert pieces and pieces[0]["function"]["name"] == "add"
        assert "".join(p["function"]["arguments"] for p in pieces) == call.function.arguments
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert wait_pool_whole(tools_server)


def test_openai_required_never_answers_markup(
    client: openai.OpenAI, tools_server: LiveServer
) -> None:
    """The issue's case (`required`, `max_tokens: 3` gave content "<tool_"): with one tool
    the cut call is that tool's; with two, a call whose name was not reached is no call."""
    one = _chat(client, tools_server, 3, tools=[ADD], tool_choice="required").choices[0]
    assert one.finish_reason == "length" and one.message.content is None
    assert [c.function.name for c in one.message.tool_calls or []] == ["add"]
    two = _chat(client, tools_server, 3, tools=[ADD, CITY], tool_choice="required").choices[0]
    assert two.finish_reason == "length" and two.message.content is None
    for chunk in client.chat.completions.create(
        model=tools_server.model,
        messages=ASK,
        tools=[ADD, CITY],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=3,
        stream=True,
    ):
        if chunk.choices:
            assert not any(m in (chunk.choices[0].delta.content or "") for m in MARKUP)
    assert wait_pool_whole(tools_server)


def _anthropic_kw(server: LiveServer, max_tokens: int, choice: dict[str, Any]) -> dict[str, Any]:
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in (ADD, CITY)
    ]
    return {
        "model": server.model,
        "max_tokens": max_tokens,
        "messages": ASK,
        "tools": tools,
        "tool_choice": choice,
        "extra_body": {"temperature": 0},
    }


def test_anthropic_forced_tool_use_cut_anywhere(
    claude: anthropic.Anthropic, tools_server: LiveServer
) -> None:
    """The issue's cases: `tool` with a small `max_tokens` gave a text block of markup and no
    tool_use; `any` gave a tool_use block followed by a stray text block."""
    named = {"type": "tool", "name": "add"}
    whole = claude.messages.create(**_anthropic_kw(tools_server, 160, named))
    assert whole.stop_reason == "tool_use"
    (full,) = whole.content
    assert isinstance(full, anthropic.types.ToolUseBlock)
    for cut in CUTS:
        msg = claude.messages.create(**_anthropic_kw(tools_server, cut, named))
        assert msg.stop_reason == "max_tokens", cut
        (use,) = msg.content  # one tool_use block, no text block
        assert isinstance(use, anthropic.types.ToolUseBlock) and use.name == "add"
        assert use.input.items() <= full.input.items()  # what of the arguments is complete
        with claude.messages.stream(**_anthropic_kw(tools_server, cut, named)) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["tool_use"], cut
        assert "text" not in events and final.stop_reason == "max_tokens"
    for cut in (3, 40, 90):  # `any`, calls in parallel: tool_use blocks only
        msg = claude.messages.create(**_anthropic_kw(tools_server, cut, {"type": "any"}))
        assert all(b.type == "tool_use" for b in msg.content), (cut, msg.content)
    assert wait_pool_whole(tools_server)
