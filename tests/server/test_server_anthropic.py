"""The Anthropic routes through the unmodified `anthropic` SDK: messages (streamed and not),
auth, error objects, and Message Batches (round trip, list, cancel, delete, kill -9)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from batch_helpers import HeldLines
from engine_steps import engine_steps
from server_harness import LiveServer, SpawnedServer

GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _ask(text: str, model: str, max_tokens: int = 6) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }


def test_message_matches_the_chat_route(
    claude: anthropic.Anthropic, client: openai.OpenAI, server: LiveServer
) -> None:
    msg = claude.messages.create(system="be brief", **_ask("Hello world", server.model), **GREEDY)
    chat = client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Hello world"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert isinstance(msg, anthropic.types.Message) and msg.id.startswith("msg_")
    block = msg.content[0]
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert (
        msg.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    )
    assert chat.usage is not None
    u = msg.usage
    assert u.cache_read_input_tokens is not None and u.cache_creation_input_tokens == 0
    assert (u.input_tokens + u.cache_read_input_tokens, u.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def test_stream_sends_anthropic_events(claude: anthropic.Anthropic, server: LiveServer) -> None:
    whole = claude.messages.create(**_ask("count to ten", server.model), **GREEDY)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/messages",
        json={**_ask("count to ten", server.model), "temperature": 0, "stream": True},
        headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"},
        timeout=60,
    ) as r:
        events = [ln.removeprefix("event: ") for ln in r.iter_lines() if ln.startswith("event:")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}
    with claude.messages.stream(**_ask("count to ten", server.model), **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason


def test_errors_are_anthropic_objects(claude: anthropic.Anthropic, server: LiveServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        claude.messages.create(**_ask("x", "no-such-model"))
    assert nf.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "The model `no-such-model` does not exist.",
        },
    }
    r = httpx.post(f"{server.url}/v1/messages", json={"model": server.model}, timeout=30)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        claude.messages.create(
            **_ask("x", server.model),
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )


def test_x_api_key_and_bearer_both_authenticate(start_server: Callable[..., LiveServer]) -> None:
    live = start_server(api_key="sekret")
    body = _ask("Hello", live.model, 2)
    ok = anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0)
    assert ok.messages.create(**body).content
    assert httpx.post(
        f"{live.url}/v1/messages", json=body, headers={"x-api-key": "sekret"}
    ).is_success
    r = httpx.post(f"{live.url}/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
            **body
        )


def _wait_ended(claude: anthropic.Anthropic, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = claude.messages.batches.retrieve(batch_id)
        if b.processing_status == "ended":
            return b
        time.sleep(0.05)
    raise AssertionError(f"message batch {batch_id} did not end")


def test_message_batch_round_trip(claude: anthropic.Anthropic, server: LiveServer) -> None:
    prompts = ["Hello world", "say hello", "tell a story"]
    direct = [claude.messages.create(**_ask(p, server.model), **GREEDY) for p in prompts]
    requests: list[Any] = [
        {"custom_id": f"r{i}", "params": {**_ask(p, server.model), "temperature": 0}}
        for i, p in enumerate(prompts)
    ]
    requests.append({"custom_id": "bad", "params": _ask("x", "no-such-model")})
    batch = claude.messages.batches.create(requests=requests)
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    ended = _wait_ended(claude, batch.id)
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (3, 1, 0)
    assert ended.ended_at is not None and ended.results_url
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    for i, d in enumerate(direct):
        got = results[f"r{i}"]
        assert got.type == "succeeded"
        assert got.message.content[0].text == d.content[0].text  # type: ignore[union-attr]
    bad = results["bad"]
    assert bad.type == "errored" and bad.error.error.type == "not_found_error"
    # Message batches list on their own route only, newest first, paged by id.
    listed = [b.id for b in claude.messages.batches.list(limit=100)]
    assert listed[0] == batch.id
    assert batch.id not in {b["id"] for b in httpx.get(f"{server.url}/v1/batches").json()["data"]}
    deleted = claude.messages.batches.delete(batch.id)
    assert deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(batch.id)


def test_message_batch_pages_and_refusals(claude: anthropic.Anthropic, server: LiveServer) -> None:
    ids = [
        claude.messages.batches.create(
            requests=[{"custom_id": "a", "params": _ask("Hello", server.model, 1)}]
        ).id
        for _ in range(3)
    ]
    page = claude.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    older = claude.messages.batches.list(limit=2, after_id=ids[1])
    assert [b.id for b in older.data][:1] == [ids[0]]
    newer = claude.messages.batches.list(limit=5, before_id=ids[0])
    assert [b.id for b in newer.data] == ids[::-1][:2]
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        claude.messages.batches.create(
            requests=[{"custom_id": "dup", "params": _ask("x", server.model)}] * 2
        )
    with pytest.raises(anthropic.BadRequestError, match=r"requests\.0\.params\.max_tokens"):
        claude.messages.batches.create(
            requests=[{"custom_id": "m", "params": {"model": server.model, "messages": []}}]
        )


def test_cancel_a_running_message_batch(claude: anthropic.Anthropic, server: LiveServer) -> None:
    params = {**_ask("tell a story", server.model, 16), "ignore_eos": True}
    with engine_steps(server.state.engine) as steps:
        steps.hold()  # nothing finishes before the cancel, on any CPU
        batch = claude.messages.batches.create(
            requests=[{"custom_id": f"c{i}", "params": params} for i in range(40)]
        )
        steps.wait(lambda: len(steps.ids(priority=1)) > 0)  # lines are in the engine
        cancelling = claude.messages.batches.cancel(batch.id)
    assert cancelling.processing_status in ("canceling", "ended")
    ended = _wait_ended(claude, batch.id)
    assert ended.request_counts.canceled > 0 and ended.cancel_initiated_at is not None
    kinds = {r.result.type for r in claude.messages.batches.results(batch.id)}
    assert "canceled" in kinds and kinds <= {"canceled", "succeeded"}


def test_message_batch_survives_kill_9(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    gate = HeldLines(tmp_path / "gate")
    srv = spawn_server(data, "--batch-gate", str(gate.folder), "--batch-concurrency", "2")
    model = srv.client().models.list().data[0].id
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    params = {**_ask("request", model, 48), "ignore_eos": True}
    n = 16
    gate.close(let_through=2)  # two results stored, then two answered lines held: kill -9
    batch = claude.messages.batches.create(
        requests=[{"custom_id": f"k{i}", "params": params} for i in range(n)]
    )
    gate.wait(lambda held: len(held.get(srv.proc.pid, [])) == 2)
    assert claude.messages.batches.retrieve(batch.id).request_counts.succeeded == 2
    srv.kill()
    gate.open()
    srv = spawn_server(data)
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    ended = _wait_ended(claude, batch.id)
    assert ended.request_counts.succeeded == n
    ids = [r.custom_id for r in claude.messages.batches.results(batch.id)]
    assert sorted(ids) == sorted(f"k{i}" for i in range(n))  # nothing lost, nothing twice


def test_x_session_id_keeps_a_messages_conversation_as_a_session(
    claude: anthropic.Anthropic, server: LiveServer
) -> None:
    sessions = server.state.engine.sessions
    convo: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Hello world"}]
    headers = {"X-Session-Id": "anthropic-convo"}
    first = claude.messages.create(
        model=server.model, max_tokens=4, messages=convo, extra_headers=headers
    )
    hits = sessions.stats.hits
    convo += [
        {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
        {"role": "user", "content": "and then?"},
    ]
    claude.messages.create(model=server.model, max_tokens=4, messages=convo, extra_headers=headers)
    assert sessions.get("anthropic-convo") is not None
    assert sessions.stats.hits == hits + 1  # the second turn reused the first's KV
    # the server is shared: give the session's blocks back for the tests that check the pool
    assert asyncio.run(server.state.serving.aeng.drop_session("anthropic-convo"))
