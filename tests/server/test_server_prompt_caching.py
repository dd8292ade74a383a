"""Prompt caching through the SDKs: Anthropic `cache_control` breakpoints (pinned with their
TTL, at most 4), cache usage in answers and in the stream's `message_start`, Claude Code's
billing line, `count_tokens?beta=true`; OpenAI's `cached_tokens` for a conversation resent
whole with no session, and `prompt_cache_key` as a hint; `GET /v1/kv` shows the tiers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_harness import LiveServer, SpawnedServer

SYSTEM = "You are a careful assistant. " * 12  # a few blocks of shared prefix


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def ask(claude: anthropic.Anthropic, model: str, text: str, **kw: Any) -> anthropic.types.Message:
    kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
    return claude.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": text}], **kw
    )


def total(u: Any) -> int:
    return int(u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens)


def pins(server: LiveServer) -> list[dict[str, Any]]:
    body = httpx.get(f"{server.url}/v1/kv", timeout=30).json()
    return list(body["pins"])


def test_cache_control_pins_the_prefix_and_usage_splits_the_prompt(
    claude: anthropic.Anthropic, server: LiveServer
) -> None:
    system: Any = [
        {"type": "text", "text": SYSTEM + "Topic: rivers.", "cache_control": {"type": "ephemeral"}}
    ]
    first = ask(claude, server.model, "Name one.", system=system)
    u = first.usage
    assert u.cache_creation_input_tokens > 0  # the system prompt was computed and kept
    assert u.input_tokens > 0 and u.input_tokens < total(u)
    again = ask(claude, server.model, "Name another.", system=system)
    assert again.usage.cache_read_input_tokens >= u.cache_creation_input_tokens - 16
    assert again.usage.cache_creation_input_tokens < 16  # only what ends in a partial block
    kept = [p for p in pins(server) if p["name"].startswith("prefix:")]
    assert kept and all(p["expires"] is not None for p in kept)
    with claude.messages.stream(
        model=server.model,
        max_tokens=4,
        system=system,
        messages=[{"role": "user", "content": "Name a third."}],
        extra_body={"temperature": 0, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.cache_read_input_tokens > 0  # already in message_start


def test_more_than_four_breakpoints_and_bad_ttls_are_refused(
    claude: anthropic.Anthropic, server: LiveServer
) -> None:
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks"):
        ask(claude, server.model, "hi", system=[block] * 5)  # type: ignore[list-item]
    bad: Any = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "9h"}}]
    with pytest.raises(anthropic.BadRequestError, match="ttl"):
        ask(claude, server.model, "hi", system=bad)


def test_claude_codes_billing_line_does_not_defeat_the_cache(
    claude: anthropic.Anthropic, server: LiveServer
) -> None:
    def system(cch: str) -> Any:
        billing = f"x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch={cch};"
        return [{"type": "text", "text": billing}, {"type": "text", "text": SYSTEM + "Code."}]

    headers = {"anthropic-beta": "claude-code-20250219,prompt-caching-2024-07-31"}
    first = ask(claude, server.model, "Go.", system=system("a1b2c"), extra_headers=headers)
    second = ask(claude, server.model, "Go.", system=system("f9e8d"), extra_headers=headers)
    assert second.usage.cache_read_input_tokens >= total(first.usage) - 16
    counted = claude.beta.messages.count_tokens(  # POST /v1/messages/count_tokens?beta=true
        model=server.model,
        system=system("zz"),
        messages=[{"role": "user", "content": "Go."}],
        betas=["token-counting-2024-11-01"],
    )
    assert counted.input_tokens == total(first.usage)


def test_a_conversation_resent_whole_reports_cached_tokens_and_a_key_pins_it(
    client: openai.OpenAI, server: LiveServer
) -> None:
    history: list[Any] = [
        {"role": "system", "content": "Resend. " + SYSTEM},
        {"role": "user", "content": "First question?"},
    ]
    prompt = 0
    for turn in range(3):
        chat = client.chat.completions.create(
            model=server.model,
            messages=history,
            max_tokens=4,
            temperature=0,
            extra_body={"prompt_cache_key": "codex-thread-1"} if turn == 2 else {},
        )
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        cached = chat.usage.prompt_tokens_details.cached_tokens or 0
        assert cached >= prompt - 16, turn  # all of the previous turn but a partial block
        prompt = chat.usage.prompt_tokens
        history += [
            {"role": "assistant", "content": chat.choices[0].message.content},
            {"role": "user", "content": f"Question {turn + 2}?"},
        ]
    assert any(p["name"] == "key:openai:codex-thread-1" for p in pins(server))
    body = httpx.get(f"{server.url}/v1/kv", timeout=30).json()
    assert set(body["tiers"]) == {"pool", "host", "disk", "shared"}


def test_a_conversation_resent_whole_is_cached_after_a_restart(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    history: list[Any] = [{"role": "user", "content": "Tell me about " + "the sea, " * 20}]
    srv = spawn_server(tmp_path / "data")
    body = {"model": "", "messages": history, "max_tokens": 4, "temperature": 0}
    body["model"] = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert srv.terminate() in (0, -15)  # a clean stop writes the cached blocks to disk
    srv2 = spawn_server(tmp_path / "data")
    history += [r.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
    r2 = httpx.post(f"{srv2.url}/v1/chat/completions", json={**body, "messages": history})
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
