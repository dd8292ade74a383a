"""Reading tool calls out of a model's text, as it streams or all at once.

`ToolCallParser.feed(delta)` takes the text released so far in pieces and answers events:
`TextDelta` (plain text, never taken back), `CallStart` (a call's id and name),
`ArgsDelta` (a piece of its arguments' JSON text) and `CallEnd`. `finish()` flushes what the
end of the output decides. A whole answer is `parse(...)`: feed everything, then finish.

Parsing is lenient: a call is a JSON object after the dialect's trigger, naming a known tool,
with an `arguments` (or `parameters`) object (or a string holding one). A call the output's end
cut short is still a call (marked incomplete, its arguments as far as they got) once its tool
is known. In a dialect with tags (hermes), markup is never text: a tag block that holds no
call, a stray end tag and a tag the end cut short are dropped. Otherwise what is not a call
stays text (a bare `{"name": ...}` object may be an answer). Text that could still become
markup is held back, as is trailing whitespace (dropped when calls follow), so streamed text
never has to be retracted.

`forced` (the grammar admits only calls) announces a call as soon as its name is read and
streams its arguments as they are generated, emits no text at all, and takes a call cut short
before its name was complete for the one tool whose name starts so. Otherwise a call is
emitted once it is complete, since until then it may still turn out to be text. The JSON
itself is read by `json` (a complete value parses; an unfinished one does not), never by hand.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from shoal.tool_calls.dialects import ToolDialect


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object's JSON text as written; cut short if not complete
    complete: bool = True


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ArgsDelta:
    index: int
    text: str


@dataclass(slots=True)
class CallEnd:
    index: int


Event = TextDelta | CallStart | ArgsDelta | CallEnd

_DECODER = json.JSONDecoder()
_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)  # a call's JSON up to its arguments object
_NAME = re.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?'
)  # as far as it got


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that `trigger` starts with."""
    for n in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0


def _decode(text: str, at: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None


@dataclass(slots=True)
class _Open:
    """A call announced (`CallStart` sent) whose arguments are still streaming."""

    call: ToolCall
    args_start: int
    args_sent: int


@dataclass
class ToolCallParser:
    dialect: ToolDialect
    names: Collection[str]
    new_id: Callable[[], str]
    forced: bool = False  # the grammar admits only calls to `names`
    max_calls: int | None = None  # 1 without parallel tool calls; later calls are dropped
    calls: list[ToolCall] = field(default_factory=list, init=False)
    text: str = field(default="", init=False)  # all text emitted so far
    _buf: str = field(default="", init=False)  # text not decided yet
    _in_call: bool = field(default=False, init=False)  # the buffer starts with a trigger
    _ws: str = field(default="", init=False)  # trailing whitespace held back
    _after_call: bool = field(default=False, init=False)  # only whitespace since a call
    _after_markup: bool = field(default=False, init=False)  # ... since dropped markup
    _skipping: bool = field(default=False, init=False)  # inside a tag block that is no call
    _open: _Open | None = field(default=None, init=False)

    @property
    def _end_tag(self) -> str:
        """The tag that closes a call in a dialect with tags, else ""."""
        return self.dialect.suffix.strip() if self.dialect.prefix.strip() else ""

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        return self._scan(final=True)

    # -- text ---------------------------------------------------------------------------
    def _emit_text(self, events: list[Event], text: str, *, hold_ws: bool) -> None:
        if self.forced:
            return  # the grammar admitted calls only: anything else is a call cut short
        if self._after_markup:  # dropped markup leaves one space where it was
            text = text.lstrip()
        text, self._ws = self._ws + text, ""
        if self._after_call:  # text after a call starts at its first visible character
            text = text.lstrip()
        if hold_ws:
            kept = text.rstrip()
            self._ws, text = text[len(kept) :], kept
        if text:
            events.append(TextDelta(text))
            self.text += text
            self._after_call = self._after_markup = False

    def _skip_block(self, final: bool) -> bool:
        """Drop a tag block that holds no call through its end tag; False while the end tag
        has not come yet."""
        end = self._buf.find(self._end_tag)
        if end < 0:
            keep = 0 if final else _partial_suffix(self._buf, self._end_tag)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._buf = self._buf[end + len(self._end_tag) :]
        self._skipping = False
        self._after_markup = True
        return True

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        trigger, end_tag = self.dialect.trigger, self._end_tag
        while True:
            if self._skipping and not self._skip_block(final):
                return events
            if not self._in_call:
                at, end_at = self._buf.find(trigger), self._buf.find(end_tag) if end_tag else -1
                if at < 0 and end_at < 0:
                    keep = max(_partial_suffix(self._buf, m) for m in (trigger, end_tag))
                    if final and not end_tag and not self.forced:
                        keep = 0  # a bare `{"na` at the end is text, unless only calls can be
                    cut = len(self._buf) - keep
                    hold_ws = not final or bool(self.calls) or keep > 0
                    self._emit_text(events, self._buf[:cut], hold_ws=hold_ws)
                    self._buf = self._buf[cut:]
                    if final:
                        if self.forced and self._buf.strip():  # a call cut before its trigger
                            self._cut_short(events, None)
                        self._buf = ""  # a tag the end cut short is not text
                        if self.calls:
                            self._ws = ""  # whitespace between or after calls is not an answer
                    return events
                if end_at >= 0 and (at < 0 or end_at < at):  # a stray end tag: markup
                    self._emit_text(events, self._buf[:end_at], hold_ws=True)
                    self._buf = self._buf[end_at + len(end_tag) :]
                    self._after_markup = True
                    continue
                self._emit_text(events, self._buf[:at], hold_ws=True)
                self._buf = self._buf[at:]
                self._in_call = True
            if not self._call(events, final):
                return events

    # -- calls --------------------------------------------------------------------------
    def _object_start(self) -> int | None:
        """Where the call's JSON object begins in the buffer (which starts with the trigger)."""
        if not self.dialect.prefix.strip():
            return 0
        at = len(self.dialect.trigger)
        while at < len(self._buf) and self._buf[at].isspace():
            at += 1
        if at == len(self._buf):
            return None
        return at if self._buf[at] == "{" else -1

    def _read(self, obj_at: int) -> tuple[str, str, int] | None:
        """(name, arguments text, end) of a complete, valid call object at `obj_at`."""
        decoded = _decode(self._buf, obj_at)
        if decoded is None:
            return None
        obj, end = decoded
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):
            inner = _decode(args, 0)
            if inner is None or not isinstance(inner[0], dict) or args[inner[1] :].strip():
                return None
            return obj["name"], args, end
        if not isinstance(args, dict):
            return None
        head = _HEAD.match(self._buf, obj_at)
        if head is not None:
            value = _decode(self._buf, head.end())
            if value is not None and value[0] == args:
                return obj["name"], self._buf[head.end() : value[1]], end
        return obj["name"], json.dumps(args), end

    def _not_a_call(self, events: list[Event]) -> bool:
        """The trigger starts no call: a tag block is dropped through its end tag; a bare
        `{"name"` is plain text. Scan on after it."""
        trigger = self.dialect.trigger
        if self._end_tag:
            self._skipping = True
        else:
            self._emit_text(events, trigger, hold_ws=True)
        self._buf = self._buf[len(trigger) :]
        self._in_call = False
        return True

    def _close(self, events: list[Event], call: ToolCall | None, rest: str) -> bool:
        """A call ended (or was cut short): record and emit it, then scan on from `rest`."""
        opened, self._open = self._open, None
        if call is not None and (self.max_calls is None or len(self.calls) < self.max_calls):
            index = len(self.calls)
            if opened is None:
                events.append(CallStart(index, call.id, call.name))
                events.append(ArgsDelta(index, call.arguments))
            self.calls.append(call)
            events.append(CallEnd(index))
        self._buf = rest
        self._in_call = False
        self._after_call = True
        self._ws = ""  # whitespace before a call is not an answer
        return True

    def _call(self, events: list[Event], final: bool) -> bool:
        """Progress on the call at the buffer's start; False while it needs more text."""
        obj_at = self._object_start()
        if obj_at == -1:
            return self._not_a_call(events) if self._open is None else self._cut(events)
        if obj_at is None:
            return final and (self._cut_short(events, None) or self._not_a_call(events))
        read = self._read(obj_at)
        if read is not None:
            name, args, end = read
            rest = self._buf[end:]
            suffix = self.dialect.suffix.strip()
            if suffix:
                stripped = rest.lstrip()
                if stripped.startswith(suffix):
                    rest = stripped[len(suffix) :]
                elif not final and suffix.startswith(stripped):
                    self._stream_args(events)
                    return False  # the end tag may still be coming
            opened = self._open
            if opened is not None:
                if len(args) > opened.args_sent - opened.args_start:
                    events.append(
                        ArgsDelta(len(self.calls), args[opened.args_sent - opened.args_start :])
                    )
                opened.call.arguments, opened.call.complete = args, True
                return self._close(events, opened.call, rest)
            return self._close(events, ToolCall(self.new_id(), name, args), rest)
        if self.forced:
            self._stream_args(events, obj_at)
        if self._open is not None and (final or (self._end_tag and self._end_tag in self._buf)):
            return self._cut(events)
        if final:
            return self._cut_short(events, obj_at) or self._not_a_call(events)
        if self._end_tag and self._end_tag in self._buf:
            return self._not_a_call(events)
        return False

    def _stream_args(self, events: list[Event], obj_at: int | None = None) -> None:
        """Announce a call once its name is read; send the arguments written since."""
        if self._open is None:
            if not self.forced or obj_at is None:
                return
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                return
            head = _HEAD.match(self._buf, obj_at)
            if head is None or head.group("name") not in self.names:
                return
            call = ToolCall(self.new_id(), head.group("name"), "", complete=False)
            self._open = _Open(call, head.end(), head.end())
            events.append(CallStart(len(self.calls), call.id, call.name))
        opened = self._open
        value = _decode(self._buf, opened.args_start)
        end = value[1] if value is not None else len(self._buf)
        if end > opened.args_sent:
            events.append(ArgsDelta(len(self.calls), self._buf[opened.args_sent : end]))
            opened.args_sent = end
        opened.call.arguments = self._buf[opened.args_start : opened.args_sent]
        opened.call.complete = value is not None

    def _cut_short(self, events: list[Event], obj_at: int | None) -> bool:
        """The output ended inside a call not yet announced: it is an incomplete call when
        its tool is known (named in full, or, forced, the only one whose name starts so).
        False when it is not."""
        name = partial = ""
        closed = False
        args, complete = "", False
        if obj_at is not None and _decode(self._buf, obj_at) is not None:
            return False  # the object ended: what it is not, a cut could not make it
        if obj_at is not None and (m := _NAME.match(self._buf, obj_at)) is not None:
            partial, closed = m.group("name"), m.group("closed") is not None
            head = _HEAD.match(self._buf, obj_at)
            if head is not None:
                value = _decode(self._buf, head.end())
                complete = value is not None and isinstance(value[0], dict)
                args = self._buf[head.end() : value[1] if complete and value else None]
        if closed:
            name = partial if partial in self.names else ""
        elif self.forced:
            matches = [n for n in self.names if n.startswith(partial)]
            name = matches[0] if len(matches) == 1 else ""
        if not name:
            return False
        return self._close(events, ToolCall(self.new_id(), name, args, complete), "")

    def _cut(self, events: list[Event]) -> bool:
        """An announced call whose output ended (or broke off) before it closed."""
        assert self._open is not None
        call = self._open.call
        call.complete = False
        self._close(events, call, "")
        return False


def parse(
    text: str,
    dialect: ToolDialect,
    names: Collection[str],
    new_id: Callable[[], str],
    *,
    forced: bool = False,
    max_calls: int | None = None,
) -> tuple[str, list[ToolCall]]:
    """(the text that is not calls, the calls) of a whole answer."""
    parser = ToolCallParser(dialect, names, new_id, forced, max_calls)
    parser.feed(text)
    parser.finish()
    return parser.text, parser.calls
