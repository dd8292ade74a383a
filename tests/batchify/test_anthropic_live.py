"""The unmodified `anthropic` SDK inside a scope against `shoal serve`'s Message Batches."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import anthropic
import httpx
from server_harness import LiveServer

from shoal.batchify import batchify

PROMPTS = [f"Hello claude {i}" for i in range(5)]


def message_batch_ids(url: str) -> set[str]:
    page = httpx.get(f"{url}/v1/messages/batches", params={"limit": 1000}, timeout=30).json()
    return {b["id"] for b in page["data"]}


def _params(model: str, text: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 4,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": text}],
        "extra_body": {"temperature": 0},
    }


def _prompt_tokens(u: anthropic.types.Usage) -> int:
    """Anthropic's `input_tokens` leaves out what the cache served or took: the whole prompt."""
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


async def _run(client: anthropic.AsyncAnthropic, model: str, **scope: Any) -> list[Any]:
    async with batchify(**scope):
        return await asyncio.gather(
            *(client.messages.create(**_params(model, p)) for p in PROMPTS),
            return_exceptions=True,
        )


async def test_calls_become_message_batches_with_direct_results(
    server: LiveServer, scope_kw: dict[str, Any]
) -> None:
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0)
    direct = [(await client.messages.create(**_params(server.model, p))) for p in PROMPTS]
    before = message_batch_ids(server.url)
    got = await _run(client, server.model, batch_size=2, **scope_kw)
    assert len(message_batch_ids(server.url) - before) == math.ceil(len(PROMPTS) / 2)
    for d, g in zip(direct, got, strict=True):
        assert isinstance(g, anthropic.types.Message)
        assert g.content[0].text == d.content[0].text  # type: ignore[union-attr]
        assert _prompt_tokens(g.usage) == _prompt_tokens(d.usage)  # cached or not
    async with batchify(**scope_kw):
        try:
            await client.messages.create(**_params("no-such-model", "x"))
        except anthropic.NotFoundError as e:
            assert isinstance(e.body, dict) and e.body["error"]["type"] == "not_found_error"
        else:
            raise AssertionError("the unknown model did not raise")


async def test_crash_between_submit_and_record_adopts_the_orphan(
    server: LiveServer, scope_kw: dict[str, Any]
) -> None:
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0)
    direct = [(await client.messages.create(**_params(server.model, p))) for p in PROMPTS]
    before = message_batch_ids(server.url)

    def crash(point: str) -> None:
        if point == "submitted":
            raise RuntimeError("crash")

    crashed = await _run(client, server.model, fault_hook=crash, **scope_kw)
    assert all(isinstance(g, Exception) for g in crashed)
    # No metadata on message batches: the orphan is proved by its custom_ids once it ends.
    got = await _run(client, server.model, **scope_kw)
    assert [g.content[0].text for g in got] == [d.content[0].text for d in direct]
    assert len(message_batch_ids(server.url) - before) == 1
