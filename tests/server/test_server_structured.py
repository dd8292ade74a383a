"""Structured outputs and tool calls through the unmodified `openai` SDK: `parse()` with a
pydantic model, `response_format`, forced tool calls (whole and streamed), the two-turn tool
loop in a session, batch lines, and the 400s. The tiny model's weights are random: only the
grammar stands between it and invalid JSON."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from batch_helpers import chat_line, read_lines, submit_batch, wait_batch
from pydantic import BaseModel, Field
from server_harness import LiveServer, wait_pool_whole

ASK = [{"role": "user", "content": "Tell me about a person."}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[bool] = Field(max_length=3)


class GetWeather(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    celsius: bool
    days: int = Field(ge=1, le=7)


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER = openai.pydantic_function_tool(GetWeather)
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 160}


@pytest.fixture(scope="module")
def server(tools_server: LiveServer) -> LiveServer:
    return tools_server


@pytest.fixture(scope="module")
def client(tools_server: LiveServer) -> openai.OpenAI:
    return tools_server.client()


def _schema(tool: Any) -> dict[str, Any]:
    return dict(tool["function"]["parameters"])


def test_parse_with_a_pydantic_model(client: openai.OpenAI, server: LiveServer) -> None:
    done = client.chat.completions.parse(
        model=server.model, messages=ASK, response_format=Person, **GREEDY
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_json_object_and_schema_streamed(client: openai.OpenAI, server: LiveServer) -> None:
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    for response_format in (fmt, {"type": "json_object"}):
        whole = client.chat.completions.create(
            model=server.model, messages=ASK, response_format=response_format, **GREEDY
        )
        chunks = list(
            client.chat.completions.create(
                model=server.model,
                messages=ASK,
                response_format=response_format,
                stream=True,
                **GREEDY,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
        value = json.loads(text)
        if response_format is fmt:
            jsonschema.validate(value, schema)
        assert isinstance(value, dict)
    assert wait_pool_whole(server)


def test_forced_tool_calls_validate(client: openai.OpenAI, server: LiveServer) -> None:
    named = client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        **GREEDY,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)  # the SDK's own helper

    one = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    assert one.choices[0].finish_reason == "tool_calls"
    (call2,) = one.choices[0].message.tool_calls or []
    by_name = {"add": _schema(ADD), "GetWeather": _schema(WEATHER)}
    jsonschema.validate(json.loads(call2.function.arguments), by_name[call2.function.name])
    assert wait_pool_whole(server)


def test_streamed_tool_call_deltas(client: openai.OpenAI, server: LiveServer) -> None:
    kw: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "tools": [ADD],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        **GREEDY,
    }
    whole = client.chat.completions.create(**kw)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "add"
    assert all(d.index == 0 for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    (expected,) = whole.choices[0].message.tool_calls or []
    assert arguments == expected.function.arguments
    assert len([d for d in deltas if d.function and d.function.arguments]) > 1  # it streamed
    jsonschema.validate(json.loads(arguments), _schema(ADD))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)
    # The SDK's streaming helper puts the pieces back together.
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.arguments == expected.function.arguments


def test_two_turn_tool_loop_in_a_session(client: openai.OpenAI, server: LiveServer) -> None:
    session = {"extra_headers": {"X-Session-Id": "tool-loop"}}
    turn = [{"role": "user", "content": "Add 2 and 3."}]
    first = client.chat.completions.create(
        model=server.model, messages=turn, tools=[ADD], tool_choice="required", **GREEDY, **session
    )
    (call,) = first.choices[0].message.tool_calls or []
    args = json.loads(call.function.arguments)
    turn += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    second = client.chat.completions.create(
        model=server.model, messages=turn, tools=[ADD], **GREEDY, **session
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the session's KV
    # tool_choice none: the same conversation answered in plain text, nothing parsed.
    plain = client.chat.completions.create(
        model=server.model, messages=turn, tools=[ADD], tool_choice="none", **GREEDY
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    info = server.state.engine.session_info("tool-loop")
    assert info is not None and info.num_blocks > 0
    pool = server.state.engine.pool
    assert pool.num_free + info.num_blocks == pool.num_blocks
    assert asyncio.run(server.state.serving.aeng.drop_session("tool-loop"))
    assert wait_pool_whole(server)


def test_out_of_tokens_is_marked_incomplete(client: openai.OpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=server.model, messages=ASK, response_format=Person, temperature=0, max_tokens=3
        )
    cut = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=[ADD],
        tool_choice="required",
        temperature=0,
        max_tokens=4,
    )
    assert cut.choices[0].finish_reason == "length"
    assert wait_pool_whole(server)


def _bad(client: openai.OpenAI, server: LiveServer, param: str | None, **kw: Any) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, max_tokens=4, **kw)
    body = e.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
    return str(body["message"])


def test_bad_input_gets_a_400_and_leaves_the_engine_whole(
    client: openai.OpenAI, server: LiveServer
) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    assert "strin" in _bad(
        client, server, "response_format", messages=ASK, response_format=bad_schema
    )
    strin = {"type": "object", "properties": {"a": {"type": "strin"}}, "required": ["a"]}
    broken_tool = {"type": "function", "function": {"name": "t", "parameters": strin}}
    assert "strin" in _bad(
        client, server, "tools", messages=ASK, tools=[broken_tool], tool_choice="required"
    )
    choice = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in _bad(
        client, server, "tool_choice", messages=ASK, tools=[ADD], tool_choice=choice
    )
    assert "tools" in _bad(client, server, "tool_choice", messages=ASK, tool_choice="required")
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    stray = [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "5"}]
    assert "call_9" in _bad(client, server, "messages.1.tool_call_id", messages=stray)
    not_json = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{**call, "function": {"name": "add", "arguments": "{"}}],
        },
    ]
    _bad(client, server, "messages.1.tool_calls.0.function.arguments", messages=not_json)
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": ASK, "response_format": {"type": "yaml"}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"
    assert wait_pool_whole(server)


def test_batch_lines_take_the_same_params(client: openai.OpenAI, server: LiveServer) -> None:
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    lines = [
        chat_line("json", server.model, "a person", 160, response_format=fmt),
        chat_line("tool", server.model, "add", 160, tools=[ADD], tool_choice="required"),
        chat_line(
            "bad",
            server.model,
            "x",
            4,
            tools=[ADD],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        ),
    ]
    batch = wait_batch(client, submit_batch(client, lines).id)
    assert batch.status == "completed"
    results = {r["custom_id"]: r for r in read_lines(client, batch.output_file_id)}
    results |= {r["custom_id"]: r for r in read_lines(client, batch.error_file_id)}
    body = results["json"]["response"]["body"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    (call,) = results["tool"]["response"]["body"]["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), _schema(ADD))
    assert results["bad"]["response"]["status_code"] == 400
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "shoal_grammar_cache_hits_total" in metrics
    assert "shoal_grammar_cache_misses_total" in metrics
