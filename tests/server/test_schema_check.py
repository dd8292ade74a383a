"""What a JSON schema must be before shoal compiles it: OpenAI's limits (each refusal naming
its limit), in strict mode only keywords xgrammar enforces (each refusal naming the keyword),
matchable in every part an output can enter, and an object for a tool's arguments. Pure
functions: no model, no server."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from shoal.engine.grammar_specs import build
from shoal.server.schema_check import (
    SchemaLimits,
    SchemaRefusal,
    check_arguments_schema,
    check_limits,
    check_strict,
)
from shoal.server.schema_matchable import check_matchable

LIMITS = SchemaLimits()


def _props(n: int, prefix: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"} for i in range(n)}}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "limit"),
    [
        (_props(5001), "max_schema_properties"),
        ({"anyOf": [_props(2600, "a"), _props(2600, "b")]}, "max_schema_properties"),
        (_nested(11), "max_schema_depth"),
        ({"type": "array", "items": {"type": "array", "items": _nested(9)}}, "max_schema_depth"),
        ({"enum": list(range(1001))}, "max_schema_enum_values"),
        ({"enum": [f"{i:060d}" for i in range(251)]}, "max_schema_large_enum_chars"),
        ({"const": "x" * 120_001}, "max_schema_chars"),
        ({"$defs": {"d" * 120_001: {}}}, "max_schema_chars"),
    ],
)
def test_past_a_limit_is_refused_naming_it(schema: dict[str, Any], limit: str) -> None:
    with pytest.raises(SchemaRefusal, match=limit) as e:
        check_limits(schema, LIMITS)
    assert e.value.reason == "limit"


def test_within_the_limits_passes_and_limits_are_configurable() -> None:
    for schema in [
        _props(5000),
        _nested(10),
        {"enum": list(range(1000))},
        {"enum": [f"{i:059d}" for i in range(250)]},  # many characters, but few values
        {"enum": [f"{i:05d}" for i in range(1000)]},
    ]:
        check_limits(schema, LIMITS)
    with pytest.raises(SchemaRefusal, match="max_schema_properties"):
        check_limits(_props(11), SchemaLimits(properties=10))


def test_a_deep_schema_costs_no_stack() -> None:
    deep: dict[str, Any] = {}
    for _ in range(20_000):  # Python's recursion limit is 1,000
        deep = {"anyOf": [deep]}  # not instance nesting: within the depth limit
    check_limits(deep, LIMITS)
    check_matchable(deep)
    check_strict(deep)


@pytest.fixture(scope="module")
def admits(tiny_chat_model: Path) -> Callable[[dict[str, Any], Any], bool]:
    """Whether the grammar shoal compiles for a schema admits a value (as constrained JSON)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    info = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=320, stop_token_ids=[tok.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def admits(schema: dict[str, Any], value: Any) -> bool:
        matcher = xgr.GrammarMatcher(build(compiler, "json", json.dumps(schema)))
        return bool(matcher.accept_string(json.dumps(value))) and bool(matcher.is_completed())

    return admits


# (keyword named, a schema using it, a value it refuses that the grammar admits all the same):
# why strict mode refuses the keyword.
IGNORED: list[tuple[str, dict[str, Any], Any]] = [
    ("not", {"type": "string", "not": {"const": "x"}}, "x"),
    (
        "if/then/else",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a"],
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        {"a": 1},
    ),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1]),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
    ),
    (
        "required 'zz'",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]},
        {"a": 1},
    ),
    ("look-arounds", {"type": "string", "pattern": "^(?!x)[a-z]+$"}, "xy"),
    ("allOf with several", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 1),
    ("oneOf with several", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    (
        "maximum next to $ref",
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "maximum": 3},
        5,
    ),
    (
        "minLength/maxLength together with pattern",
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "abcdef",
    ),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("enum or const values that its type excludes", {"enum": ["a", 2], "type": "integer"}, "a"),
]


@pytest.mark.parametrize(("keyword", "schema", "value"), IGNORED, ids=[k for k, *_ in IGNORED])
def test_strict_mode_refuses_what_xgrammar_ignores(
    admits: Callable[[dict[str, Any], Any], bool], keyword: str, schema: dict[str, Any], value: Any
) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(value, schema)
    assert admits(schema, value)  # the installed xgrammar still lets it through
    with pytest.raises(SchemaRefusal, match=re.escape(keyword)) as e:
        check_strict(schema)
    assert e.value.reason == "strict" and "(at #)" in str(e.value)


def test_strict_mode_names_where_the_keyword_is() -> None:
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"not": {}}}}}
    with pytest.raises(SchemaRefusal, match="not \\(at #/properties/items/items\\)"):
        check_strict(schema)
    for fmt in ("iri", "idn-email", "regex"):  # standard formats xgrammar does not check
        with pytest.raises(SchemaRefusal, match=f"format {fmt}"):
            check_strict({"type": "string", "format": fmt})


def test_strict_mode_takes_what_xgrammar_enforces() -> None:
    """The schemas pydantic and the OpenAI SDK write pass."""
    from openai import pydantic_function_tool
    from pydantic import BaseModel, Field

    class Inner(BaseModel):
        tags: list[str] = Field(max_length=3)
        kind: int | None = Field(ge=0, multiple_of=2)

    class Outer(BaseModel):
        name: str = Field(pattern="^[A-Z][a-z]+$")
        when: str = Field(json_schema_extra={"format": "date-time"})
        inner: Inner
        items: list[Inner]

    check_strict(pydantic_function_tool(Outer)["function"]["parameters"])  # strict, as sent
    check_strict(Outer.model_json_schema())
    check_strict({"type": "integer", "multipleOf": 3})
    check_strict({"type": "string", "enum": ["a", "b"]})


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}, "the schema matches"),
        ({"anyOf": []}, "the schema matches"),
        (
            {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
            "schema matches",
        ),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "the schema matches"),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/l"}},
                "$defs": {"l": {"$ref": "#/$defs/l"}},
            },
            "at #/properties/a",
        ),
    ],
)
def test_what_matches_nothing_is_refused(schema: dict[str, Any], where: str) -> None:
    with pytest.raises(SchemaRefusal, match=where) as e:
        check_matchable(schema)
    assert e.value.reason == "unmatchable"


def test_recursion_with_a_way_out_is_matchable() -> None:
    for schema in [
        {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional
        {"anyOf": [{"type": "array", "items": {"$ref": "#"}, "minItems": 1}, {"type": "null"}]},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"type": "object", "properties": {"a": False}},  # never entered
    ]:
        check_matchable(schema)


def test_a_tools_arguments_are_an_object() -> None:
    for schema in [{"type": "object"}, {"type": "object", "properties": {}}, None, {}]:
        check_arguments_schema(schema)
    for schema in [{"type": "string"}, {"properties": {"a": {}}}, {"type": ["object", "null"]}]:
        with pytest.raises(SchemaRefusal, match='needs "type": "object"') as e:
            check_arguments_schema(schema)
        assert e.value.reason == "not_object"
