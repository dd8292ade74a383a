"""Constrained decoding on the real bundled SmolLM2-135M: schemas in one batch with free
requests all validate, and a forced tool call through the fallback prompt feeds a second turn
in a session. (`benchmarks/structured_acceptance.py` is the 200-request version, over HTTP.)"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest

from shoal import SamplingParams
from shoal.sampling_params import StructuredOutput
from shoal.tool_calls import (
    FunctionTool,
    calls_format,
    dialect_for,
    parse,
    render,
    structural_tag,
)

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 30}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _object(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a cat", _object(name=NAME, lives=_int(1, 9))),
    (
        "a traffic light",
        _object(
            state={"enum": ["red", "amber", "green"]},
            seconds={"type": "number", "minimum": 0, "maximum": 120},
        ),
    ),
    ("three fruits", {"type": "array", "items": NAME, "minItems": 3, "maxItems": 3}),
    (
        "a library",
        _object(
            name=NAME,
            open={"type": "boolean"},
            books={
                "type": "array",
                "items": _object(title=NAME, pages=_int(1, 2000)),
                "maxItems": 2,
            },
        ),
    ),
    ("a mountain", _object(name=NAME, metres=_int(0, 8849))),
    ("a yes or no", _object(answer={"enum": ["yes", "no"]})),
]
ADD = FunctionTool(
    "add",
    "Add two integers",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)


def _whole(llm: Any) -> bool:
    engine = llm.engine
    return not engine.has_unfinished_requests() and engine.pool.num_free == engine.pool.num_blocks


def test_schemas_in_one_batch_with_free_requests(bundled_llm: Any) -> None:
    ask = [[{"role": "user", "content": f"Invent {what}. Answer in JSON."}] for what, _ in SCHEMAS]
    prompts = [bundled_llm.apply_chat_template(m) for m in ask]
    constrained = [
        SamplingParams(
            max_tokens=160, temperature=0.8, seed=i, structured=StructuredOutput(json=schema)
        )
        for i, (_, schema) in enumerate(SCHEMAS)
    ]
    free = [SamplingParams(max_tokens=24, temperature=0.8, seed=i) for i in range(4)]
    outs = bundled_llm.generate(prompts + prompts[:4], constrained + free, use_tqdm=False)
    for (what, schema), out in zip(SCHEMAS, outs, strict=False):
        assert out.finish_reason == "stop", (what, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert _whole(bundled_llm)


def test_forced_call_then_an_answer_in_a_session(bundled_llm: Any) -> None:
    dialect, native = dialect_for(bundled_llm.tokenizer.chat_template)
    assert not native  # SmolLM2's template knows no tools: the fallback prompt
    turn: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 plus 25?"}]
    messages, tools = render(turn, [ADD], dialect, native)
    force = StructuredOutput(structural_tag=structural_tag(calls_format(dialect, [ADD], False)))
    (first,) = bundled_llm.generate(
        bundled_llm.engine.apply_chat_template(messages, tools),
        SamplingParams(max_tokens=64, temperature=0, structured=force),
        session_id="smol-tools",
        use_tqdm=False,
    )
    ids = (f"call_{i}" for i in itertools.count())
    text, calls = parse(first.text, dialect, {"add"}, lambda: next(ids))
    assert first.finish_reason == "stop" and text == ""
    (call,) = calls
    args = json.loads(call.arguments)
    jsonschema.validate(args, ADD.schema)
    fn = {"name": "add", "arguments": args}
    turn += [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "function": fn}]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    messages, tools = render(turn, [ADD], dialect, native)
    (second,) = bundled_llm.generate(
        bundled_llm.engine.apply_chat_template(messages, tools),
        SamplingParams(max_tokens=32, temperature=0),
        session_id="smol-tools",
        use_tqdm=False,
    )
    assert second.num_cached_tokens > 0 and second.text  # the session's KV carried the call
    assert bundled_llm.sessions.drop("smol-tools")
    assert _whole(bundled_llm)
