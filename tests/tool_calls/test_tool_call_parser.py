"""Reading calls out of text: whole or streamed in any pieces, the same answer; lenient about
what is not a call; forced calls stream their arguments; text is never taken back."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ArgsDelta,
    CallEnd,
    CallStart,
    Event,
    TextDelta,
    ToolCallParser,
    ToolDialect,
    parse,
)

NAMES = {"get_weather", "add"}
WEATHER = HERMES.call_text("get_weather", {"city": "Paris", "days": [1, 2]})
ADD = HERMES.call_text("add", {"a": 1, "note": "x } y"})


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(
    text: str, dialect: ToolDialect = HERMES, **kw: object
) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse(text, dialect, NAMES, _ids(), **kw)  # type: ignore[arg-type]
    return content, [(c.name, c.arguments) for c in calls]


def _stream(text: str, cuts: list[int], **kw: object) -> tuple[ToolCallParser, list[Event]]:
    parser = ToolCallParser(HERMES, NAMES, _ids(), **kw)  # type: ignore[arg-type]
    events: list[Event] = []
    start = 0
    for cut in [*sorted(cuts), len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    return parser, events + parser.finish()


def test_calls_and_text_apart() -> None:
    text = f"Let me check.\n{WEATHER}\n{ADD}\n"
    assert _parse(text) == (
        "Let me check.",
        [
            ("get_weather", '{"city": "Paris", "days": [1, 2]}'),
            ("add", '{"a": 1, "note": "x } y"}'),
        ],
    )


def test_what_is_not_a_call_stays_text() -> None:
    unknown = HERMES.call_text("nope", {})
    for text in [
        "no calls here <tool_ca",
        f"{unknown} after",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # cut short
        "<tool_call>\n[1, 2]\n</tool_call> and on",
        '<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>',
        "<tool_call> plain words </tool_call>",
    ]:
        assert _parse(text) == (text, []), text


def test_arguments_as_a_json_string_and_a_missing_end_tag() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}'
    assert _parse(text) == ("", [("add", '{"a": 2}')])


def test_llama3_json_calls() -> None:
    text = LLAMA3_JSON.call_text("add", {"a": 1}) + "\n" + LLAMA3_JSON.call_text("add", {"a": 2})
    assert _parse(text, LLAMA3_JSON) == ("", [("add", '{"a": 1}'), ("add", '{"a": 2}')])
    assert _parse('{"name": "Bob", "age": 3}', LLAMA3_JSON) == ('{"name": "Bob", "age": 3}', [])


def test_without_parallel_calls_only_the_first_counts() -> None:
    assert _parse(f"{WEATHER}\n{ADD}", max_calls=1)[1] == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}')
    ]


def test_a_forced_call_streams_its_arguments_as_they_come() -> None:
    parser, events = _stream(ADD, list(range(len(ADD))), stream_arguments=True)
    starts = [e for e in events if isinstance(e, CallStart)]
    pieces = [e.text for e in events if isinstance(e, ArgsDelta)]
    assert [(s.index, s.name) for s in starts] == [(0, "add")]
    assert len(pieces) > 5 and "".join(pieces) == '{"a": 1, "note": "x } y"}'
    assert events.index(starts[0]) < min(
        i for i, e in enumerate(events) if isinstance(e, ArgsDelta)
    )
    assert isinstance(events[-1], CallEnd)
    assert [c.complete for c in parser.calls] == [True]


def test_a_forced_call_cut_short_is_marked_incomplete() -> None:
    text = ADD[:-20]
    parser, events = _stream(text, [10, 30, 40], stream_arguments=True)
    (call,) = parser.calls
    assert not call.complete and json.loads(call.arguments + '"}') == {"a": 1, "note": "x"}
    assert call.parsed_arguments() == {}
    assert not any(isinstance(e, TextDelta) for e in events)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(
        [
            f"Sure.\n{WEATHER}\n{ADD}",
            f"{ADD}\n\n trailing words \n",
            "plain text with a <tool_ and a < sign\n\n",
            f"{WEATHER}<tool_call>broken</tool_call> then text",
            "multi-byte é 😀 then " + HERMES.call_text("add", {"a": 1}),
        ]
    ),
    st.lists(st.integers(0, 200), max_size=12),
    st.booleans(),
)
def test_any_pieces_give_the_whole_answer(text: str, cuts: list[int], forced: bool) -> None:
    whole = parse(text, HERMES, NAMES, _ids(), stream_arguments=forced)
    parser, events = _stream(text, [c for c in cuts if c <= len(text)], stream_arguments=forced)
    assert (parser.text, parser.calls) == whole
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == parser.text
    for i, call in enumerate(parser.calls):
        args = "".join(e.text for e in events if isinstance(e, ArgsDelta) and e.index == i)
        assert args == call.arguments
    if parser.calls:  # whitespace around calls is not an answer
        assert parser.text == parser.text.strip()
