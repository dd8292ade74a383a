"""The Responses API through the unmodified `openai` SDK: create, retrieve, delete,
input_items, input_tokens, `responses.stream()`, `responses.parse()`, a chain that reuses its
session's KV, function calls kept in the chain, background responses (replay, cancel), a batch
of `/v1/responses` lines, and the 404s and 400s. The tiny model's weights are random, so its
answers are gibberish: the tests check the protocol, never the words."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from batch_helpers import read_lines, submit_batch, wait_batch
from pydantic import BaseModel, Field
from server_harness import LiveServer
from server_tiny_model import build_tiny_model

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 8}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two small numbers",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
# What a message's events are, in the order the SDK's stream helper checks.
MESSAGE_EVENTS = re.compile(
    r"response\.created response\.in_progress "
    r"response\.output_item\.added response\.content_part\.added "
    r"(response\.output_text\.delta )*"
    r"response\.output_text\.done response\.content_part\.done response\.output_item\.done "
    r"response\.(completed|incomplete)"
)


class Mood(BaseModel):
    mood: Literal["calm", "busy"]
    level: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def live(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    """A server of its own: the chains leave sessions holding KV blocks."""
    model = build_tiny_model(tmp_path_factory.mktemp("responses-model"), max_positions=4096)
    return start_server(engine={"model": str(model)})


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return live.client()


def _post(live: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/responses", json={"model": live.model, **body}, timeout=60)


def test_create_retrieve_input_items_delete(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.responses.create(
        model=live.model,
        input="Hello world",
        instructions="Be brief.",
        metadata={"run": "one"},
        **GREEDY,
    )
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.instructions == "Be brief." and r.metadata == {"run": "one"} and r.store
    assert r.usage is not None and r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id).data
    assert [(i.type, i.role) for i in items] == [("message", "user")]  # type: ignore[union-attr]
    assert items[0].content[0].text == "Hello world"  # type: ignore[union-attr]
    count = client.responses.input_tokens.count(
        model=live.model, input="Hello world", instructions="Be brief."
    )
    assert count.input_tokens == r.usage.input_tokens
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_chain_computes_only_its_new_items(client: openai.OpenAI, live: LiveServer) -> None:
    """From the second turn on the chain is a session: the third turn reuses everything the
    second turn computed (its prompt and output but the last token, whose KV is never made)."""
    r1 = client.responses.create(model=live.model, input="Count to ten, chain one.", **GREEDY)
    r2 = client.responses.create(
        model=live.model, input="Again.", previous_response_id=r1.id, **GREEDY
    )
    r3 = client.responses.create(
        model=live.model, input="Once more.", previous_response_id=r2.id, **GREEDY
    )
    assert r2.usage and r3.usage and r2.previous_response_id == r1.id
    assert r2.usage.input_tokens_details.cached_tokens > 0
    cached = r3.usage.input_tokens_details.cached_tokens
    assert cached == r2.usage.input_tokens + r2.usage.output_tokens - 1
    assert r3.usage.input_tokens_details.cache_write_tokens == r3.usage.input_tokens - cached
    items = client.responses.input_items.list(r3.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant", "user"]  # type: ignore[union-attr]
    assert [items[1].id, items[3].id] == [r1.output[0].id, r2.output[0].id]
    newest = client.responses.input_items.list(r3.id, limit=2)
    assert newest.has_more and [i.id for i in newest.data] == [items[4].id, items[3].id]
    after = client.responses.input_items.list(r3.id, order="asc", after=items[2].id).data
    assert [i.id for i in after] == [items[3].id, items[4].id]


def test_stream_events_in_the_sdk_helpers_order(client: openai.OpenAI, live: LiveServer) -> None:
    with client.responses.stream(
        model=live.model, input="How are you?", text_format=Mood, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert MESSAGE_EVENTS.fullmatch(" ".join(e.type for e in events)), [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert isinstance(final.output_parsed, Mood) and final.status == "completed"
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.usage == final.usage


def test_parse_with_a_pydantic_model(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.responses.parse(
        model=live.model, input="Your mood?", text_format=Mood, temperature=0
    )
    assert isinstance(r.output_parsed, Mood)
    assert r.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_function_calls_stay_in_the_chain(client: openai.OpenAI, live: LiveServer) -> None:
    r1 = client.responses.create(
        model=live.model,
        input="What is 2 + 3?",
        tools=[ADD],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "add"},
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=160,  # the tiny tokenizer spends about a token per character
    )
    calls = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and len(calls) == 1 and calls[0].name == "add"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"a", "b"}
    answer = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}
    r2 = client.responses.create(
        model=live.model,
        input=[answer],  # type: ignore[list-item]
        previous_response_id=r1.id,
        tools=[ADD],  # type: ignore[list-item]
        **GREEDY,
    )
    assert r2.usage and r2.usage.input_tokens_details.cached_tokens > 0
    kinds = [i.type for i in client.responses.input_items.list(r2.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]
    stray = {**answer, "call_id": "call_nobody_made"}
    with pytest.raises(openai.BadRequestError, match="answers no tool call"):
        client.responses.create(
            model=live.model,
            input=[stray],
            previous_response_id=r1.id,
            **GREEDY,  # type: ignore[list-item]
        )


def test_truncation_auto_drops_the_oldest_exchanges(live: LiveServer) -> None:
    """Three long exchanges do not fit the 4,096 positions: `disabled` (the default) is a 400,
    `auto` leaves out the oldest until the prompt fits, keeping the system message."""
    long = " ".join(map(str, range(400)))  # ~1,500 tokens: digits are not merged here
    items = [
        {"role": "user", "content": f"{i}: {long}"} if i % 2 == 0
        else {"role": "assistant", "content": "noted"}
        for i in range(5)
    ]  # fmt: skip
    body = {"input": items, "instructions": "Be brief.", **GREEDY}
    refused = _post(live, body)
    assert (
        refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    )
    fitted = _post(live, {**body, "truncation": "auto"})
    assert fitted.status_code == 200, fitted.text
    whole = _post(live, {**body, "input": items[4:]})  # the last exchange alone
    assert whole.json()["usage"]["input_tokens"] < fitted.json()["usage"]["input_tokens"] < 4096
    assert fitted.json()["truncation"] == "auto"


def test_unknown_ids_are_404s_in_openai_shape(client: openai.OpenAI, live: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(
            model=live.model, input="x", previous_response_id="resp_nope", **GREEDY
        )
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for call in (
        lambda: client.responses.retrieve("resp_nope"),
        lambda: client.responses.delete("resp_nope"),
        lambda: client.responses.cancel("resp_nope"),
        lambda: client.responses.input_items.list("resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    r = _post(live, {"input": "x", "previous_response_id": "resp_" + "0" * 24, **GREEDY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"previous_response_id": "resp_x", "conversation": "conv_1"}, "together"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"background": True, "store": False}, "store"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "type"),
        ({"tools": [ADD], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "empty"),
    ],
)
def test_bad_input_is_a_400(live: LiveServer, body: dict[str, Any], needle: str) -> None:
    r = _post(live, {"input": "hi", **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] + str(r.json()["error"]["param"])


def test_unrunnable_tools_are_dropped_with_a_warning(live: LiveServer) -> None:
    tools = [{"type": "web_search"}, {"type": "image_generation"}, ADD]
    r = _post(live, {"input": "hi", "tools": tools, **GREEDY})
    assert r.status_code == 200, r.text
    assert "image_generation, web_search" in r.headers["warning"]
    assert [t["type"] for t in r.json()["tools"]] == ["function"]
    assert r.headers["x-session-id"] == r.json()["id"]  # a new chain is named by its first id


def test_store_false_keeps_nothing(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.responses.create(model=live.model, input="forget me", store=False, **GREEDY)
    assert not r.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=live.model, input="x", previous_response_id=r.id, **GREEDY)


def _wait_done(client: openai.OpenAI, response_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {r.status}")


def test_background_response_and_its_replay(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.responses.create(
        model=live.model, input="In the background", background=True, **GREEDY
    )
    assert r.status == "queued" and r.background
    done = _wait_done(client, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    events = list(client.responses.retrieve(r.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].response.id == r.id  # type: ignore[union-attr]
    tail = list(client.responses.retrieve(r.id, stream=True, starting_after=2))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[3:]]
    with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
        client.responses.cancel(r.id)  # it has finished
    plain = client.responses.create(model=live.model, input="not in the background", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="only a background"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.BadRequestError, match="only a background"):
        list(client.responses.retrieve(plain.id, stream=True))


@pytest.fixture
def engine_held(live: LiveServer) -> Iterator[None]:
    """The engine's step thread held between two steps (nothing runs) until the test ends."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(60)

    thread = threading.Thread(target=lambda: asyncio.run(live.state.serving.aeng.call(hold)))
    thread.start()
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        thread.join(30)


def test_cancel_a_background_response(
    client: openai.OpenAI, live: LiveServer, engine_held: None
) -> None:
    r = client.responses.create(model=live.model, input="Cancel me", background=True, **GREEDY)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: the same answer


def test_a_client_that_leaves_aborts_and_stores_nothing(live: LiveServer) -> None:
    def aborts() -> float:
        text = httpx.get(f"{live.url}/metrics").text
        m = re.search(r'^shoal_requests_total\{finish_reason="abort"\} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    before = aborts()
    body = {"model": live.model, "input": "a long story", "stream": True}
    body["max_output_tokens"] = 3000  # far more than it can make before the client leaves
    with httpx.stream("POST", f"{live.url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        deltas = 0
        for line in lines:
            deltas += '"response.output_text.delta"' in line
            if deltas == 3:
                break
    deadline = time.monotonic() + 60
    while aborts() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 1
    rid = created["response"]["id"]
    assert httpx.get(f"{live.url}/v1/responses/{rid}").status_code == 404


def test_a_batch_of_responses_runs_each_line_once(client: openai.OpenAI, live: LiveServer) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": live.model, "input": f"line {i}", **GREEDY},
        }
        for i in range(6)
    ]
    batch = submit_batch(client, lines, endpoint="/v1/responses")
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6
    out = read_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == [f"r{i}" for i in range(6)]
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["object"] == "response"
        assert (
            client.responses.retrieve(body["id"]).output_text
            == body["output"][0]["content"][0]["text"]
        )
    assert done.usage is not None and done.usage.input_tokens > 0


def test_store_rows_are_bounded(
    start_server: Callable[..., LiveServer], tmp_path: Path, live: LiveServer
) -> None:
    bounded = start_server(engine={"model": str(live.state.config.engine.model)}, responses_keep=2)
    c = bounded.client()
    ids = [c.responses.create(model=bounded.model, input=f"n{i}", **GREEDY).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
