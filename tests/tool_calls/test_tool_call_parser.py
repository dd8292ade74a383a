"""Reading calls out of text: whole or streamed in any pieces, the same answer; lenient about
what is not a call, but markup is never text; a call cut short is still a call once its tool
is known; forced calls stream their arguments and leave no text; text is never taken back."""

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


def test_markup_is_never_text() -> None:
    """A tag block that holds no call, a stray end tag and a tag the end cut short are dropped;
    the text around them stays."""
    unknown = HERMES.call_text("nope", {})
    for text, content in [
        ("no calls here <tool_ca", "no calls here"),
        (f"{unknown} after", "after"),
        ("<tool_call>\n[1, 2]\n</tool_call> and on", "and on"),
        ('<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>', ""),
        ("<tool_call> plain words </tool_call>", ""),
        ("<tool_call> never closed, then words", ""),
        ("stray </tool_call> end tag", "stray end tag"),
        (f"{ADD}\n</tool_", ""),
    ]:
        assert _parse(text)[0] == content, text


def test_what_is_not_a_call_stays_text_without_tags() -> None:
    for text in [
        '{"name": "Bob", "age": 3}',
        'a {"na',
        '{"name": "nope", "parameters": {}}',
        '{"name": "add", "age": 3}',  # a known name, but an object that is no call
    ]:
        assert _parse(text, LLAMA3_JSON) == (text, []), text


def test_a_call_cut_short_is_an_incomplete_call_once_its_tool_is_known() -> None:
    for dialect in (HERMES, LLAMA3_JSON):
        head = dialect.head("add")
        content, calls = parse(head + '{"a": 1, "no', dialect, NAMES, _ids())
        assert content == "" and [(c.name, c.arguments, c.complete) for c in calls] == [
            ("add", '{"a": 1, "no', False)
        ]
    # The name not finished: without a grammar forcing calls, no tool is known. A tag is
    # markup, dropped; a bare object may be an answer, kept.
    assert _parse('<tool_call>\n{"name": "ad') == ("", [])
    assert _parse('{"name": "ad', LLAMA3_JSON) == ('{"name": "ad', [])


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
    parser, events = _stream(ADD, list(range(len(ADD))), forced=True)
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
    parser, events = _stream(text, [10, 30, 40], forced=True)
    (call,) = parser.calls
    assert not call.complete and json.loads(call.arguments + '"}') == {"a": 1, "note": "x"}
    assert not any(isinstance(e, TextDelta) for e in events)


def test_a_forced_call_cut_before_its_name_is_the_one_tool_it_can_be() -> None:
    """`max_tokens` can end a forced answer inside the markup or the name: the call is still
    a call (no arguments yet) when only one tool's name starts so; never text."""
    weather = ("get_weather", '{"city": "Paris", "days": [1, 2]}', True)
    for text, calls in [
        ("<tool_", []),  # get_weather or add
        ('<tool_call>\n{"name": "a', [("add", "", False)]),
        ('<tool_call>\n{"name": "add", "argu', [("add", "", False)]),
        (f'{WEATHER}\n<tool_call>\n{{"name": "get', [weather, ("get_weather", "", False)]),
    ]:
        content, got = parse(text, HERMES, NAMES, _ids(), forced=True)
        assert (content, [(c.name, c.arguments, c.complete) for c in got]) == ("", calls), text
    (one,) = parse("<tool_", HERMES, {"add"}, _ids(), forced=True)[1]  # a named tool choice
    assert (one.name, one.complete) == ("add", False)
    for text in ('{"na', '{"name": "a'):  # Llama 3.1's bare calls likewise
        (one,) = parse(text, LLAMA3_JSON, {"add"}, _ids(), forced=True)[1]
        assert (one.name, one.arguments) == ("add", "")


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(
        [
            f"Sure.\n{WEATHER}\n{ADD}",
            f"{ADD}\n\n trailing words \n",
            "plain text with a <tool_ and a < sign\n\n",
            f"{WEATHER}<tool_call>broken</tool_call> then text",
            "multi-byte é 😀 then " + HERMES.call_text("add", {"a": 1}),
            f"{ADD}\n<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Pa',
            "words </tool_call> and <tool_call> never closed",
        ]
    ),
    st.lists(st.integers(0, 200), max_size=12),
    st.booleans(),
)
def test_any_pieces_give_the_whole_answer(text: str, cuts: list[int], forced: bool) -> None:
    whole = parse(text, HERMES, NAMES, _ids(), forced=forced)
    parser, events = _stream(text, [c for c in cuts if c <= len(text)], forced=forced)
    assert (parser.text, parser.calls) == whole
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == parser.text
    for i, call in enumerate(parser.calls):
        args = "".join(e.text for e in events if isinstance(e, ArgsDelta) and e.index == i)
        assert args == call.arguments
    if parser.calls:  # whitespace around calls is not an answer
        assert parser.text == parser.text.strip()
