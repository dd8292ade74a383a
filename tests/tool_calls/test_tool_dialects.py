"""Dialects: which one a chat template speaks, and that the grammar forcing calls admits
exactly the calls the dialect writes (compiled for a real byte-level tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shoal.engine.structured import Grammars
from shoal.sampling_params import StructuredOutput
from shoal.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    FunctionTool,
    calls_format,
    dialect_for,
    structural_tag,
)

ADD = FunctionTool(
    "add",
    "Add",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}},
        "required": ["a", "b"],
    },
)
NOTE = FunctionTool("note")  # no schema: any arguments object


def test_the_template_names_the_dialect() -> None:
    hermes = "{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>"
    llama = '{% if tools %}{{ tools }}{% endif %}{"name": x, "parameters": y}'
    assert dialect_for(hermes) == (HERMES, True)
    assert dialect_for(llama) == (LLAMA3_JSON, True)
    assert dialect_for("{{ messages }}") == (HERMES, False)
    assert dialect_for(None) == (HERMES, False)


def test_call_text_and_the_openai_shape() -> None:
    assert HERMES.call_text("add", {"a": 1}) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert LLAMA3_JSON.call_text("add", {}) == '{"name": "add", "parameters": {}}'
    assert NOTE.as_openai() == {
        "type": "function",
        "function": {"name": "note", "parameters": {"type": "object"}},
    }


@pytest.fixture(scope="module")
def grammars(tiny_chat_model: Path) -> Grammars:
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    return Grammars(tok, 320, [tok.eos_token_id])


def _admits(grammars: Grammars, fmt: dict[str, object], text: str) -> bool:
    state = grammars.state_for(StructuredOutput(structural_tag=structural_tag(fmt)))
    return bool(state.matcher.accept_string(text)) and bool(state.matcher.is_completed())


@pytest.mark.parametrize("dialect", [HERMES, LLAMA3_JSON])
def test_the_grammar_admits_the_dialects_calls_only(grammars: Grammars, dialect) -> None:  # type: ignore[no-untyped-def]
    one = calls_format(dialect, [ADD, NOTE], parallel=False)
    many = calls_format(dialect, [ADD, NOTE], parallel=True)
    add = dialect.call_text("add", {"a": 7, "b": "xy"})
    note = dialect.call_text("note", {"any": [1, {"thing": None}]})
    assert _admits(grammars, one, add) and _admits(grammars, one, note)
    assert _admits(grammars, many, add + dialect.separator + note)
    assert not _admits(grammars, one, add + dialect.separator + note)
    for wrong in [
        dialect.call_text("add", {"a": "7", "b": "xy"}),  # a string for an integer
        dialect.call_text("add", {"a": 7, "b": "long!"}),  # past maxLength
        dialect.call_text("add", {"a": 7}),  # a required field missing
        dialect.call_text("sub", {"a": 7, "b": "x"}),  # no such tool
        "Sure! " + add,  # text before the call
        add.replace('{"a": 7, "b": "xy"}', '{"a":7,"b":"xy"}'),  # one JSON style for all
        "",
    ]:
        assert not _admits(grammars, many, wrong), wrong
    assert (
        json.loads(add.removeprefix(dialect.prefix).removesuffix(dialect.suffix))["name"] == "add"
    )
