"""Reading tool calls out of a model's text, as it streams or all at once.

`ToolCallParser.feed(delta)` takes the text released so far in pieces and answers events:
`TextDelta` (plain text, never taken back), `CallStart` (a call's id and name),
`ArgsDelta` (a piece of its arguments' JSON text) and `CallEnd`. `finish()` flushes what the
end of the output decides. A whole answer is `parse(...)`: feed everything, then finish.

Parsing is lenient: a call is a JSON object after the dialect's trigger, naming a known tool,
with an `arguments` (or `parameters`) object (or a string holding one). Anything else stays
text. Text that could still become a trigger is held back, as is trailing whitespace (dropped
when calls follow), so streamed text never has to be retracted.

With `stream_arguments` (a call forced by the grammar, so known to be well formed), a call is
announced as soon as its name is read and its arguments stream as they are generated.
Otherwise a call is emitted once it is complete, since until then it may still turn out to be
text. The JSON itself is read by `json` (a complete value parses; an unfinished one does not),
never by hand.
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

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict ({} for a call the output's end cut short)."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


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
    stream_arguments: bool = False
    max_calls: int | None = None  # 1 without parallel tool calls; later calls are dropped
    calls: list[ToolCall] = field(default_factory=list, init=False)
    text: str = field(default="", init=False)  # all text emitted so far
    _buf: str = field(default="", init=False)  # text not decided yet
    _in_call: bool = field(default=False, init=False)  # the buffer starts with a trigger
    _ws: str = field(default="", init=False)  # trailing whitespace held back
    _after_call: bool = field(default=False, init=False)  # only whitespace since a call
    _open: _Open | None = field(default=None, init=False)

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        return self._scan(final=True)

    # -- text ---------------------------------------------------------------------------
    def _emit_text(self, events: list[Event], text: str, *, hold_ws: bool) -> None:
        text, self._ws = self._ws + text, ""
        if self._after_call:  # text after a call starts at its first visible character
            text = text.lstrip()
        if hold_ws:
            kept = text.rstrip()
            self._ws, text = text[len(kept) :], kept
        if text:
            events.append(TextDelta(text))
            self.text += text
            self._after_call = False

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        trigger = self.dialect.trigger
        while True:
            if not self._in_call:
                at = self._buf.find(trigger)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buf, trigger)
                    cut = len(self._buf) - keep
                    self._emit_text(events, self._buf[:cut], hold_ws=not final or bool(self.calls))
                    self._buf = self._buf[cut:]
                    if final and self.calls:
                        self._ws = ""  # whitespace between or after calls is not an answer
                    return events
                self._emit_text(events, self._buf[:at], hold_ws=True)
                self._ws = ""
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
        """The trigger turned out to start plain text: emit it and scan on after it."""
        trigger = self.dialect.trigger
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
        return True

    def _call(self, events: list[Event], final: bool) -> bool:
        """Progress on the call at the buffer's start; False while it needs more text."""
        obj_at = self._object_start()
        if obj_at == -1 or (obj_at is None and final):
            return self._not_a_call(events) if self._open is None else self._cut(events)
        if obj_at is None:
            return False
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
        if self.stream_arguments:
            self._stream_args(events, obj_at)
        ended = self.dialect.suffix.strip() and self.dialect.suffix.strip() in self._buf
        if final or ended:
            return self._not_a_call(events) if self._open is None else self._cut(events)
        return False

    def _stream_args(self, events: list[Event], obj_at: int | None = None) -> None:
        """Announce a call once its name is read; send the arguments written since."""
        if self._open is None:
            if not self.stream_arguments or obj_at is None:
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
    stream_arguments: bool = False,
    max_calls: int | None = None,
) -> tuple[str, list[ToolCall]]:
    """(the text that is not calls, the calls) of a whole answer."""
    parser = ToolCallParser(dialect, names, new_id, stream_arguments, max_calls)
    parser.feed(text)
    parser.finish()
    return parser.text, parser.calls
