"""Provider behaviour a live server does not produce on demand, through in-memory fakes:
polling through 5xx/429 with Retry-After, merged and shuffled result files, expiry, the
Anthropic adapter end to end, limits that split batches, cancel on abort, vanished batches."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from batchify_helpers import FAST
from fake_providers import FakeAnthropic, FakeOpenAI

from shoal.batchify import BatchCancelledError, BatchExpiredError, batchify
from shoal.batchify.adapters import ADAPTERS

OPENAI_URL = "http://openai.fake/v1"


def _openai() -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=OPENAI_URL, api_key="k1", max_retries=0)


def _ask(client: openai.AsyncOpenAI, text: str, model: str = "m") -> Any:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}])


def _kw(tmp_path: Path, fake: Any, **extra: Any) -> dict[str, Any]:
    return {
        **FAST,
        "cache_path": tmp_path / "c.sqlite3",
        "provider_transport": fake.transport(),
        **extra,
    }


async def test_polls_survive_5xx_and_429_and_results_map_by_custom_id(tmp_path: Path) -> None:
    fake = FakeOpenAI(
        poll_failures=[
            httpx.Response(503, headers={"retry-after": "0.05"}),
            httpx.Response(429, headers={"retry-after-ms": "20"}),
        ],
        special={"late": "expired", "wrong": "bad"},
    )
    client = _openai()
    texts = ["a", "b", "late", "c", "wrong", "d"]
    async with batchify(**_kw(tmp_path, fake)) as b:
        got = await asyncio.gather(*(_ask(client, t) for t in texts), return_exceptions=True)
    assert [g.choices[0].message.content for g in got if not isinstance(g, Exception)] == [
        "echo a",
        "echo b",
        "echo c",
        "echo d",
    ]
    assert isinstance(got[2], BatchExpiredError)
    assert isinstance(got[4], openai.BadRequestError) and got[4].status_code == 400
    assert b.stats.batches == 1 and not fake.poll_failures


async def test_limits_split_batches_and_a_full_queue_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpenAI()
    client = _openai()
    monkeypatch.setattr(ADAPTERS["openai"], "max_requests", 2)
    async with batchify(**_kw(tmp_path, fake, batch_size=100, window_s=60)) as b:
        t0 = time.monotonic()
        await asyncio.gather(*(_ask(client, t) for t in "abcd"))
        assert time.monotonic() - t0 < 30  # two full batches went at once, not after 60 s
        assert b.stats.batches == 2
    monkeypatch.setattr(ADAPTERS["openai"], "max_requests", 50_000)
    monkeypatch.setattr(ADAPTERS["openai"], "max_bytes", 450)  # two lines
    async with batchify(**_kw(tmp_path, fake, batch_size=100, window_s=0.1)) as b:
        await asyncio.gather(*(_ask(client, t) for t in "efghi"))
    assert b.stats.batches == 3


async def test_accounts_and_models_never_share_a_batch(tmp_path: Path) -> None:
    fake = FakeOpenAI()
    other = openai.AsyncOpenAI(base_url=OPENAI_URL, api_key="k2", max_retries=0)
    async with batchify(**_kw(tmp_path, fake)) as b:
        await asyncio.gather(_ask(_openai(), "x"), _ask(other, "x"), _ask(_openai(), "x", "m2"))
    assert b.stats.batches == 3
    keys = {r.headers["authorization"] for r in fake.requests if r.url.path == "/v1/batches"}
    assert keys == {"Bearer k1", "Bearer k2"}


async def test_vanished_batch_is_submitted_again(tmp_path: Path) -> None:
    fake = FakeOpenAI()
    client = _openai()
    async with batchify(**_kw(tmp_path, fake)):
        await _ask(client, "a")
    (bid,) = [k for k in fake.batches if k != "_files"]
    del fake.batches[bid]  # the provider deleted it (30 days on)
    async with batchify(**_kw(tmp_path, fake)) as b:
        assert (await _ask(client, "a")).choices[0].message.content == "echo a"
    assert b.stats.batches == 1


async def test_cancel_on_abort(tmp_path: Path) -> None:
    fake = FakeOpenAI(hold=True)
    client = _openai()
    calls: list[asyncio.Task[Any]] = []
    with pytest.raises(RuntimeError, match="user abort"):
        async with batchify(**_kw(tmp_path, fake, cancel_on_abort=True)):
            calls = [asyncio.create_task(_ask(client, t)) for t in "ab"]
            while not fake.batches.keys() - {"_files"}:
                await asyncio.sleep(0.02)
            raise RuntimeError("user abort")
    assert fake.cancelled == ["batch_1"]
    for c in calls:
        with pytest.raises(BatchCancelledError):
            await c


def _claude(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="ak", max_retries=0)


async def test_anthropic_params_round_trip_and_results_map_to_sdk_errors(tmp_path: Path) -> None:
    fake = FakeAnthropic(
        special={"late": "expired", "stop": "canceled", "slow": "rate_limit_error"},
        poll_failures=[httpx.Response(529, headers={"retry-after": "0.01"})],
    )
    client = _claude("http://anthropic.fake")
    params: dict[str, Any] = {
        "model": "claude-x",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "stop_sequences": ["\n\nEND"],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": "t", "description": "d", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "u1"},
    }
    texts = ["hi", "late", "stop", "slow"]
    async with batchify(**_kw(tmp_path, fake)):
        got = await asyncio.gather(
            *(
                client.messages.create(
                    messages=[{"role": "user", "content": t}],
                    extra_body={"temperature": 0.3},
                    extra_headers={"anthropic-beta": "b1"},
                    **params,
                )
                for t in texts
            ),
            return_exceptions=True,
        )
    assert isinstance(got[0], anthropic.types.Message)
    assert got[0].content[0].text == "echo hi"  # type: ignore[union-attr]
    # Typed errors, and AnthropicErrors too, so the SDK neither wraps nor retries them.
    assert isinstance(got[1], BatchExpiredError) and isinstance(got[1], anthropic.AnthropicError)
    assert isinstance(got[2], BatchCancelledError)
    assert isinstance(got[3], anthropic.RateLimitError)
    (batch,) = fake.batches.values()
    sent = {r["params"]["messages"][0]["content"]: r["params"] for r in batch["requests"]}
    assert sent["hi"] == {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.3,
        **params,
    }
    created = next(r for r in fake.requests if r.url.path == "/v1/messages/batches")
    assert created.headers["anthropic-beta"] == "b1"
    assert "ak" in (created.headers.get("x-api-key") or created.headers["authorization"])


async def test_anthropic_orphan_is_adopted_after_its_custom_ids_match(tmp_path: Path) -> None:
    fake = FakeAnthropic()
    client = _claude("http://anthropic.fake")

    def crash(point: str) -> None:
        if point == "submitted":
            raise ConnectionAbortedError(point)

    async def ask(**kw: Any) -> list[Any]:
        async with batchify(**_kw(tmp_path, fake, **kw)):
            return await asyncio.gather(
                *(
                    client.messages.create(
                        model="c", max_tokens=4, messages=[{"role": "user", "content": t}]
                    )
                    for t in "xy"
                ),
                return_exceptions=True,
            )

    crashed = await ask(fault_hook=crash)
    assert all(isinstance(g, anthropic.APIConnectionError) for g in crashed)
    # A batch of the same size from someone else, newer: its custom_ids give it away.
    fake.batches["msgbatch_decoy"] = {
        **next(iter(fake.batches.values())),
        "id": "msgbatch_decoy",
        "requests": [
            {"custom_id": f"other-{t}", "params": {"model": "c", "messages": [{"content": t}]}}
            for t in "xy"
        ],
    }
    got = await ask()
    assert [g.content[0].text for g in got] == ["echo x", "echo y"]
    assert len(fake.batches) == 2  # adopted, not submitted again
