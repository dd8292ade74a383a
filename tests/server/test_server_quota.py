"""`shoal serve --quota`: admission per API key and model, tokens reconciled, 429s the SDK
understands, and the quota routes served beside the OpenAI ones."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import LiveServer

CONFIG = """
[serve]
rpm = 3
tpm = 120
window_s = 60

[[limit]]
key = "global:jobs:concurrency"
kind = "concurrency"
capacity = 2
"""


@pytest.fixture(scope="module")
def live(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    path = Path(tmp_path_factory.mktemp("quota")) / "limits.toml"
    path.write_text(CONFIG)
    return start_server(quota_config=path)


def used(live: LiveServer) -> dict[str, int]:
    return {u["key"]: u["used"] for u in httpx.get(f"{live.url}/v1/usage").json()["usage"]}


def key(live: LiveServer, token: str, what: str) -> str:
    """The limit key of an API key's budget: the token itself is kept only as a hash."""
    return f"serve:key-{hashlib.sha256(token.encode()).hexdigest()[:16]}:{live.model}:{what}"


def test_requests_per_minute_per_api_key(live: LiveServer) -> None:
    alice = live.client(api_key="alice")
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for _ in range(3):
        alice.completions.create(**body)
    with pytest.raises(openai.RateLimitError) as e:
        alice.completions.create(**body)
    response = e.value.response
    assert 1 <= int(response.headers["retry-after"]) <= 60
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    assert used(live)[key(live, "alice", "rpm")] == 3
    # Another key has its own budget.
    assert live.client(api_key="bob").completions.create(**body).choices


def test_tokens_are_reserved_then_reconciled(live: LiveServer) -> None:
    carol = live.client(api_key="carol")
    out = carol.completions.create(
        model=live.model, prompt="Hello world", max_tokens=40, temperature=0
    )
    assert out.usage is not None
    # Charged what was used, not prompt + 40; the request itself counts once.
    assert used(live)[key(live, "carol", "tpm")] == out.usage.total_tokens
    assert used(live)[key(live, "carol", "rpm")] == 1
    # A request that could never fit the budget is refused for good (no retry helps).
    with pytest.raises(openai.BadRequestError) as e:
        carol.completions.create(model=live.model, prompt="Hello", max_tokens=500)
    assert e.value.response.json()["error"]["code"] == "request_too_large"


def test_a_stream_is_charged_what_it_streamed(live: LiveServer) -> None:
    headers = {"Authorization": "Bearer dave"}
    body = {
        "model": live.model,
        "prompt": "Hi there",
        "max_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{live.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    total = json.loads(lines[-1][6:])["usage"]["total_tokens"]
    assert used(live)[key(live, "dave", "tpm")] == total


def test_quota_routes_are_served_beside_the_api(live: LiveServer) -> None:
    from shoal.quota import new_lease_id

    item = {
        "lease_id": new_lease_id(),
        "requirements": [{"key": "global:jobs:concurrency", "amount": 1}],
    }
    r = httpx.post(f"{live.url}/v1/reserve/batch", json={"requests": [item]})
    assert r.status_code == 200 and r.json()["results"][0]["allowed"] is True
    assert used(live)["global:jobs:concurrency"] == 1
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"  # still the server's
    scrape = httpx.get(f"{live.url}/metrics").text  # the quota's metrics join the server's
    assert 'shoal_quota_limit_used{key="global:jobs:concurrency",kind="concurrency"} 1.0' in scrape
    assert "shoal_kv_cache_blocks_free" in scrape


def test_serve_with_a_bad_quota_file_says_so_before_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoal.cli import main

    bad = tmp_path / "limits.toml"
    bad.write_text("[serve]\nrpm = 0\n")
    assert main(["serve", "--quota", str(bad), "--model", str(tmp_path / "none")]) == 2
    assert "rpm must be a positive integer" in capsys.readouterr().err


def _events(live: LiveServer, path: str, body: dict[str, object], token: str) -> list[dict]:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.stream("POST", f"{live.url}{path}", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


def _message_tokens(usage: dict[str, int]) -> int:
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return sum(usage.get(k) or 0 for k in parts) + usage.get("output_tokens", 0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_and_responses_are_charged_what_they_used(live: LiveServer, stream: bool) -> None:
    """The Anthropic and Responses routes settle their leases as chat does."""
    token = f"erin-{stream}"
    message = {
        "model": live.model,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    if stream:
        events = _events(live, "/v1/messages", {**message, "stream": True}, token)
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        delta = next(e for e in events if e["type"] == "message_delta")["usage"]
        spent = _message_tokens({**start, "output_tokens": delta["output_tokens"]})
    else:
        headers = {"Authorization": f"Bearer {token}"}
        r = httpx.post(f"{live.url}/v1/messages", json=message, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        spent = _message_tokens(r.json()["usage"])
    assert used(live)[key(live, token, "tpm")] == spent

    token = f"frank-{stream}"
    body = {"model": live.model, "input": "Hi", "max_output_tokens": 6, "store": False}
    if stream:
        events = _events(live, "/v1/responses", {**body, "stream": True}, token)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        spent = events[-1]["response"]["usage"]["total_tokens"]
    else:
        response = live.client(api_key=token).responses.create(**body)
        assert response.usage is not None
        spent = response.usage.total_tokens
    assert used(live)[key(live, token, "tpm")] == spent
