"""A response's output items, built as the answer's text arrives, and the stream events that
tell them, in the order the `openai` SDK's `responses.stream()` helper checks:

    response.created, response.in_progress,
    per item:  response.output_item.added
               message:       response.content_part.added, response.output_text.delta...,
                              response.output_text.done, response.content_part.done
               function_call: response.function_call_arguments.delta...,
                              response.function_call_arguments.done
               response.output_item.done (the whole item: Codex reads calls there)
    then response.completed | response.incomplete | response.failed

`Output` is used by the non-streaming path too (its events simply go unsent), so a stored
response and a streamed one are built by the same code. `Sequenced` numbers events and
writes them as server-sent events.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.server.ids import new_id
from shoal.server.structured import ToolPlan
from shoal.tool_calls import ArgsDelta, CallEnd, CallStart, Event, TextDelta, ToolCallParser

Events = list[dict[str, Any]]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Output:
    """Output items of one answer: messages for text, function calls for tool calls."""

    def __init__(self, tools: ToolPlan | None, namespaces: dict[str, str] | None = None) -> None:
        self.reader: ToolCallParser | None = tools.parser() if tools is not None else None
        self.namespaces = namespaces or {}
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> open call item

    def feed(self, text: str, finished: bool) -> Events:
        """Events for newly released `text` (and for the end of the answer when `finished`)."""
        if self.reader is None:
            parsed: list[Event] = [TextDelta(text)] if text else []
        else:
            parsed = self.reader.feed(text) + (self.reader.finish() if finished else [])
        events: Events = []
        for e in parsed:
            if isinstance(e, TextDelta):
                events += self._text(e.text)
            elif isinstance(e, CallStart):
                events += self._close_message("completed") + self._call_start(e)
            elif isinstance(e, ArgsDelta):
                events += self._args(e)
            elif isinstance(e, CallEnd):
                events += self._call_end(e.index, "completed")
        return events

    def close(self, status: str) -> Events:
        """End the open items: `status` is the response's (an incomplete answer leaves its
        open items incomplete). An answer that said nothing is one empty message."""
        item_status = "completed" if status == "completed" else "incomplete"
        events: Events = []
        for index in list(self._calls):
            events += self._call_end(index, item_status)
        if not self.items:
            events += self._text("")
        return events + self._close_message(item_status)

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        snapshot = {**item, "content": []} if item["type"] == "message" else dict(item)
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": snapshot,
        }

    def _text(self, text: str) -> Events:
        events: Events = []
        msg = self._message
        if msg is None:
            msg = self._message = {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [_part("")],
            }
            where = {"item_id": msg["id"], "output_index": len(self.items), "content_index": 0}
            events += [
                self._added(msg),
                {"type": "response.content_part.added", **where, "part": _part("")},
            ]
        if text:
            msg["content"][0]["text"] += text
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": msg["id"],
                    "output_index": self.items.index(msg),
                    "content_index": 0,
                    "delta": text,
                    "logprobs": [],
                }
            )
        return events

    def _close_message(self, status: str) -> Events:
        msg, self._message = self._message, None
        if msg is None:
            return []
        msg["status"] = status
        where = {"item_id": msg["id"], "output_index": self.items.index(msg), "content_index": 0}
        part = msg["content"][0]
        return [
            {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **where, "part": dict(part)},
            self._item_done(msg),
        ]

    def _item_done(self, item: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "response.output_item.done",
            "output_index": self.items.index(item),
            "item": json.loads(json.dumps(item)),
        }

    def _call_start(self, e: CallStart) -> Events:
        call: dict[str, Any] = {
            "id": new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": e.id,
            "name": e.name,
            "arguments": "",
        }
        if e.name in self.namespaces:
            call["namespace"] = self.namespaces[e.name]
        self._calls[e.index] = call
        return [self._added(call)]

    def _args(self, e: ArgsDelta) -> Events:
        call = self._calls[e.index]
        call["arguments"] += e.text
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": call["id"],
                "output_index": self.items.index(call),
                "delta": e.text,
            }
        ]

    def _call_end(self, index: int, status: str) -> Events:
        call = self._calls.pop(index)
        call["status"] = status
        done = {
            "type": "response.function_call_arguments.done",
            "item_id": call["id"],
            "output_index": self.items.index(call),
            "name": call["name"],
            "arguments": call["arguments"],
        }
        return [done, self._item_done(call)]


class Sequenced:
    """Numbers a response's events from 0 and writes each as a server-sent event; keeps
    them when asked (background responses replay their stream)."""

    def __init__(self, keep: bool = False) -> None:
        self.next = 0
        self.kept: Events | None = [] if keep else None

    def number(self, event: dict[str, Any]) -> dict[str, Any]:
        event = {**event, "sequence_number": self.next}
        self.next += 1
        if self.kept is not None:
            self.kept.append(event)
        return event


def sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
