"""Schemas shoal will not compile get a 400 naming the rule, in each API's own error shape,
before anything compiles: past a limit, a keyword strict mode cannot enforce, a part that
matches nothing, tool parameters that are not an object. Non-strict mode takes what it cannot
enforce, best effort. Through the unmodified `openai` and `anthropic` SDKs and raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_harness import LiveServer, wait_pool_whole

ASK = [{"role": "user", "content": "Tell me about a name."}]
NOT_A_STRING = {  # the example: xgrammar drops `not`
    "type": "object",
    "properties": {"name": {"not": {"type": "string"}}},
    "required": ["name"],
    "additionalProperties": False,
}
LOOP = {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}
TOO_MANY = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5001)}}
TOO_DEEP: dict[str, Any] = {"type": "string"}
for _ in range(11):
    TOO_DEEP = {"type": "object", "properties": {"a": TOO_DEEP}, "required": ["a"]}


@pytest.fixture(scope="module")
def client(tools_server: LiveServer) -> openai.OpenAI:
    return tools_server.client()


@pytest.fixture(scope="module")
def claude(tools_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tools_server.url, api_key="unused", max_retries=0)


def _answer_format(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def _tool(schema: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "t", "parameters": schema, "strict": strict}}


def _openai_400(client: openai.OpenAI, server: LiveServer, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=8, **kw)
    assert isinstance(e.value.body, dict)
    return e.value.body


@pytest.mark.parametrize(
    ("schema", "strict", "needle"),
    [
        (TOO_MANY, False, "max_schema_properties"),
        (TOO_DEEP, False, "max_schema_depth"),
        ({"enum": [f"v{i}" for i in range(1001)]}, False, "max_schema_enum_values"),
        (LOOP, False, "matches no finite JSON value"),
        (NOT_A_STRING, True, "strict mode cannot enforce not (at #/properties/name)"),
        ({"type": "array", "uniqueItems": True}, True, "uniqueItems"),
    ],
)
def test_openai_answer_schemas(
    client: openai.OpenAI,
    tools_server: LiveServer,
    schema: dict[str, Any],
    strict: bool,
    needle: str,
) -> None:
    body = _openai_400(client, tools_server, response_format=_answer_format(schema, strict))
    assert body["param"] == "response_format" and body["type"] == "invalid_request_error"
    assert body["message"].startswith("response_format.json_schema.schema: ")
    assert needle in body["message"], body
    # the same schema as a forced tool's argument
    arguments = {
        "type": "object",
        "$defs": schema.get("$defs", {}),  # where its $refs point
        "properties": {"x": {k: v for k, v in schema.items() if k != "$defs"}},
        "required": ["x"],
    }
    body = _openai_400(
        client, tools_server, tools=[_tool(arguments, strict)], tool_choice="required"
    )
    assert body["param"] == "tools.0.function.parameters"
    assert needle.split(" (at")[0] in body["message"], body


def test_openai_tool_parameters_must_be_an_object(
    client: openai.OpenAI, tools_server: LiveServer
) -> None:
    body = _openai_400(client, tools_server, tools=[_tool({"type": "string"})])
    assert body["param"] == "tools.0.function.parameters"
    assert 'needs "type": "object"' in body["message"]


def test_non_strict_takes_what_it_cannot_enforce(
    client: openai.OpenAI, tools_server: LiveServer
) -> None:
    """Best effort: the keyword is ignored, the rest holds (the answer parses and has its
    required property)."""
    done = client.chat.completions.create(
        model=tools_server.model,
        messages=ASK,
        response_format=_answer_format(NOT_A_STRING, strict=False),
        temperature=0,
        max_tokens=64,
    )
    choice = done.choices[0]
    if choice.finish_reason == "stop":
        assert "name" in json.loads(choice.message.content or "")
    assert wait_pool_whole(tools_server)


def test_anthropic_input_schemas(claude: anthropic.Anthropic, tools_server: LiveServer) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"name": "t", "input_schema": TOO_MANY}, "tools.0.input_schema: the schema has more"),
        ({"name": "t", "input_schema": {"type": "string"}}, 'needs "type": "object"'),
        ({"name": "t", "input_schema": {**LOOP, "type": "object"}}, "matches no finite"),
        ({"name": "t", "input_schema": NOT_A_STRING, "strict": True}, "cannot enforce not"),
    ]
    for tool, needle in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model=tools_server.model,
                max_tokens=8,
                messages=ASK,
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "any"},
            )
        body = e.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error"
        assert needle in body["error"]["message"], body
    # count_tokens checks the tools the same way
    with pytest.raises(anthropic.BadRequestError, match="max_schema_properties"):
        claude.messages.count_tokens(
            model=tools_server.model,
            messages=ASK,  # type: ignore[arg-type]
            tools=[{"name": "t", "input_schema": TOO_MANY}],  # type: ignore[list-item]
        )


def test_raw_http_and_metrics(tools_server: LiveServer) -> None:
    r = httpx.post(
        f"{tools_server.url}/v1/chat/completions",
        json={
            "model": tools_server.model,
            "messages": ASK,
            "response_format": _answer_format(NOT_A_STRING, strict=True),
        },
        timeout=30,
    )
    assert r.status_code == 400 and "cannot enforce not" in r.json()["error"]["message"]
    metrics = httpx.get(f"{tools_server.url}/metrics", timeout=30).text
    for reason in ("limit", "strict", "unmatchable", "not_object"):
        assert f'shoal_schema_refusals_total{{reason="{reason}"}}' in metrics
    for name in ("cache_bytes", "compile_seconds_total", "compile_refusals_total"):
        assert f"shoal_grammar_{name}" in metrics
