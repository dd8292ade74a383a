"""Anthropic tool use through the unmodified `anthropic` SDK: forced `tool_use` blocks (whole
and streamed as `input_json_delta`s), the tool loop with `tool_result`, `count_tokens`,
Message Batches with tools, and the 400s."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from server_harness import LiveServer, wait_pool_whole

ADD = {
    "name": "add",
    "description": "Add two small numbers",
    "input_schema": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a", "b"],
    },
}
CITY = {
    "name": "city_time",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lima"]}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "Add 2 and 3."}]


@pytest.fixture(scope="module")
def claude(tools_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tools_server.url, api_key="unused", max_retries=0)


def _kw(server: LiveServer, **extra: Any) -> dict[str, Any]:
    """A request's params; greedy, through `extra_body` (the SDK in use takes no temperature)."""
    return {
        "model": server.model,
        "max_tokens": 160,
        "messages": ASK,
        "tools": [ADD, CITY],
        "extra_body": {"temperature": 0},
        **extra,
    }


def _body(kw: dict[str, Any]) -> dict[str, Any]:
    """The same params as a JSON body."""
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    return {**body, **kw["extra_body"]}


def _uses(msg: anthropic.types.Message) -> list[anthropic.types.ToolUseBlock]:
    return [b for b in msg.content if isinstance(b, anthropic.types.ToolUseBlock)]


def test_forced_tool_use(claude: anthropic.Anthropic, tools_server: LiveServer) -> None:
    named = claude.messages.create(**_kw(tools_server, tool_choice={"type": "tool", "name": "add"}))
    assert named.stop_reason == "tool_use"
    (use,) = _uses(named)
    assert use.id.startswith("toolu_") and use.name == "add"
    jsonschema.validate(use.input, ADD["input_schema"])
    one = claude.messages.create(
        **_kw(tools_server, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    )
    (use,) = _uses(one)
    jsonschema.validate(use.input, {"add": ADD, "city_time": CITY}[use.name]["input_schema"])
    assert wait_pool_whole(tools_server)


def test_streamed_input_json_deltas(claude: anthropic.Anthropic, tools_server: LiveServer) -> None:
    kw = _kw(tools_server, tool_choice={"type": "tool", "name": "add"})
    whole = claude.messages.create(**kw)
    with httpx.stream(
        "POST",
        f"{tools_server.url}/v1/messages",
        json={**_body(kw), "stream": True},
        headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"},
        timeout=60,
    ) as r:
        events = [ln.removeprefix("event: ") for ln in r.iter_lines() if ln.startswith("event:")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events.count("content_block_delta") > 1  # the arguments streamed in pieces
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(u.name, u.input) for u in _uses(final)] == [(u.name, u.input) for u in _uses(whole)]


def test_tool_loop_with_tool_result(claude: anthropic.Anthropic, tools_server: LiveServer) -> None:
    first = claude.messages.create(**_kw(tools_server, tool_choice={"type": "any"}))
    (use, *_) = _uses(first)
    turn = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "5"},
                {"type": "text", "text": "And now in words?"},
            ],
        },
    ]
    second = claude.messages.create(**_kw(tools_server, messages=turn))
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(
        model=tools_server.model, messages=turn, tools=[ADD, CITY]
    )
    u = second.usage  # input_tokens is the part not read from (nor written to) the cache
    total = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    assert counted.input_tokens == total
    plain = claude.messages.count_tokens(model=tools_server.model, messages=ASK)
    assert 0 < plain.input_tokens < counted.input_tokens
    assert wait_pool_whole(tools_server)


def test_bad_tool_use_gets_a_400(claude: anthropic.Anthropic, tools_server: LiveServer) -> None:
    stray = [
        *ASK,
        {"role": "assistant", "content": "Let me see."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]},
    ]
    cases: list[tuple[dict[str, Any], str]] = [
        (_kw(tools_server, messages=stray), "toolu_x"),
        (_kw(tools_server, tool_choice={"type": "tool", "name": "nope"}), "nope"),
        (
            _kw(
                tools_server,
                tools=[
                    {
                        "name": "t",
                        "input_schema": {
                            "type": "object",
                            "properties": {"a": {"type": "strin"}},
                            "required": ["a"],
                        },
                    }
                ],
                tool_choice={"type": "any"},
            ),
            "strin",
        ),
        (_kw(tools_server, tools=None, tool_choice={"type": "any"}), "no tools"),
    ]
    for kw, needle in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(**kw)
        body = e.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert needle in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model", messages=ASK)
    assert wait_pool_whole(tools_server)


def test_message_batches_take_tools(claude: anthropic.Anthropic, tools_server: LiveServer) -> None:
    params = _body(_kw(tools_server, tool_choice={"type": "tool", "name": "city_time"}))
    batch = claude.messages.batches.create(
        requests=[
            {"custom_id": "tool", "params": params},
            {
                "custom_id": "bad",
                "params": {**params, "tool_choice": {"type": "tool", "name": "x"}},
            },
        ]
    )
    deadline = time.monotonic() + 120
    while claude.messages.batches.retrieve(batch.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    ok = results["tool"]
    assert ok.type == "succeeded" and ok.message.stop_reason == "tool_use"
    (use,) = _uses(ok.message)
    jsonschema.validate(use.input, CITY["input_schema"])
    assert results["bad"].type == "errored"


def test_count_tokens_counts_a_prompt_of_any_length(
    claude: anthropic.Anthropic, tools_server: LiveServer
) -> None:
    """Counting is how a client learns its prompt is too long: the count comes back, and the
    same prompt is then refused by /v1/messages (bounded only by the body's byte limit)."""
    long = [{"role": "user", "content": "hello world " * 6000}]
    counted = claude.messages.count_tokens(model=tools_server.model, messages=long, tools=[ADD])
    assert counted.input_tokens > tools_server.state.engine.max_model_len
    with pytest.raises(anthropic.BadRequestError, match="tokens"):
        claude.messages.create(model=tools_server.model, max_tokens=4, messages=long)
