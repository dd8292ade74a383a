"""Two tenants on one server (`--keys`), through the official SDKs: neither can see, read,
continue, cancel or delete the other's files, batches, message batches, responses or sessions
(404, as if they did not exist), each sees its own; batch lines run as their batch's tenant;
an unknown key is a 401 in each API's shape; `/metrics` asks for its own key; the quota
service's routes are the operator's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from batch_helpers import chat_line, read_lines, submit_batch, upload, wait_batch
from server_harness import LiveServer
from tenant_helpers import ALPHA, BETA, LONG, OPERATOR, cached_chat, claude, keys_file, oai

METRICS_KEY = "key-metrics"


@pytest.fixture(scope="module")
def live(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    folder = Path(tmp_path_factory.mktemp("tenants"))
    (folder / "limits.toml").write_text("[serve]\nrpm = 1000\n")
    return start_server(
        keys_file=keys_file(folder),
        api_key=OPERATOR,
        metrics_key=METRICS_KEY,
        quota_config=folder / "limits.toml",
    )


def missing(call: Callable[[], Any]) -> None:
    """`call` answers 404, as for an id that never existed."""
    with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)):
        call()


def test_files_and_batches_are_their_tenants(live: LiveServer) -> None:
    alpha, beta = oai(live, ALPHA), oai(live, BETA)
    batch = submit_batch(alpha, [chat_line("l1", live.model, "Hi", 2)])
    file_id = batch.input_file_id
    done = wait_batch(alpha, batch.id)
    assert done.status == "completed" and done.output_file_id
    for f in (file_id, done.output_file_id):
        missing(lambda f=f: beta.files.retrieve(f))
        missing(lambda f=f: beta.files.content(f))
        missing(lambda f=f: beta.files.delete(f))
    missing(lambda: beta.batches.retrieve(batch.id))
    missing(lambda: beta.batches.cancel(batch.id))
    missing(  # nor can beta start a batch over alpha's file
        lambda: beta.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    )
    assert file_id not in {f.id for f in beta.files.list()}
    assert batch.id not in {b.id for b in beta.batches.list()}
    assert not beta.files.list(after=file_id).data  # no page tells alpha's file exists
    # alpha sees its own, output included
    assert {file_id, done.output_file_id} <= {f.id for f in alpha.files.list()}
    assert batch.id in {b.id for b in alpha.batches.list()}
    assert read_lines(alpha, done.output_file_id)[0]["custom_id"] == "l1"
    own = upload(beta, b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", '
                 b'"body": {"model": "m", "prompt": "p"}}\n')  # fmt: skip
    assert own in {f.id for f in beta.files.list()} and own not in {
        f.id for f in alpha.files.list()
    }
    assert beta.files.delete(own).deleted


def test_message_batches_are_their_tenants(live: LiveServer) -> None:
    alpha, beta = claude(live, ALPHA), claude(live, BETA)
    params: Any = {
        "model": live.model,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    batch = alpha.messages.batches.create(requests=[{"custom_id": "m1", "params": params}])
    missing(lambda: beta.messages.batches.retrieve(batch.id))
    missing(lambda: beta.messages.batches.cancel(batch.id))
    missing(lambda: beta.messages.batches.delete(batch.id))
    missing(lambda: list(beta.messages.batches.results(batch.id)))
    assert batch.id not in {b.id for b in beta.messages.batches.list()}
    assert batch.id in {b.id for b in alpha.messages.batches.list()}
    assert alpha.messages.batches.retrieve(batch.id).id == batch.id


def test_responses_are_their_tenants(live: LiveServer) -> None:
    alpha, beta = oai(live, ALPHA), oai(live, BETA)
    first = alpha.responses.create(model=live.model, input="Hello", max_output_tokens=2)
    missing(lambda: beta.responses.retrieve(first.id))
    missing(lambda: beta.responses.input_items.list(first.id))
    missing(lambda: beta.responses.cancel(first.id))
    missing(lambda: beta.responses.delete(first.id))
    missing(  # nor continue it
        lambda: beta.responses.create(
            model=live.model, input="Go on", previous_response_id=first.id, max_output_tokens=2
        )
    )
    assert alpha.responses.retrieve(first.id).id == first.id
    second = alpha.responses.create(
        model=live.model, input="Go on", previous_response_id=first.id, max_output_tokens=2
    )
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    alpha.responses.delete(second.id)
    missing(lambda: alpha.responses.retrieve(second.id))


def test_sessions_are_their_tenants(live: LiveServer) -> None:
    """Like-named sessions of two tenants are two sessions: beta's turn gets none of alpha's
    KV, and each lists only its own."""
    alpha, beta = oai(live, ALPHA), oai(live, BETA)
    history: list[Any] = [{"role": "user", "content": "Session talk. " + LONG}]
    header = {"X-Session-Id": "shared-name"}
    assert cached_chat(alpha, live.model, history, extra_headers=header) == 0
    assert cached_chat(beta, live.model, history, extra_headers=header) == 0
    assert cached_chat(alpha, live.model, history, extra_headers=header) > 0

    def kv(key: str) -> dict[str, Any]:
        r = httpx.get(f"{live.url}/v1/kv", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        return dict(r.json())

    mine, theirs = kv(ALPHA), kv(BETA)
    assert "shared-name" in [s["session_id"] for s in mine["sessions"]]  # and its chains'
    assert [s["session_id"] for s in theirs["sessions"]] == ["shared-name"]
    assert [p["name"] for p in theirs["pins"]] == ["session:shared-name"]
    assert "tiers" not in theirs  # the operator's figures are in /metrics


def test_batch_lines_run_as_their_batchs_tenant(live: LiveServer) -> None:
    alpha, beta = oai(live, ALPHA), oai(live, BETA)
    text = "Batch line. " + LONG
    batch = submit_batch(alpha, [chat_line("l1", live.model, text, 2)])
    assert wait_batch(alpha, batch.id).status == "completed"
    messages: list[Any] = [{"role": "user", "content": text}]
    assert cached_chat(beta, live.model, messages) == 0
    assert cached_chat(alpha, live.model, messages) > 0  # the line's KV is alpha's


def test_unknown_keys_are_401_in_each_apis_shape(live: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError) as o:
        oai(live, "nope").models.list()
    assert o.value.response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as a:
        claude(live, "nope").messages.create(
            model=live.model, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert a.value.response.json()["error"]["type"] == "authentication_error"
    assert oai(live, OPERATOR).models.list().data  # --api-key is the default tenant's
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_metrics_ask_for_their_own_key(live: LiveServer) -> None:
    url = f"{live.url}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {ALPHA}"}).status_code == 401
    ok = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert ok.status_code == 200 and "shoal_" in ok.text


def test_the_quota_routes_are_the_operators(live: LiveServer) -> None:
    def limits(key: str) -> int:
        r = httpx.get(f"{live.url}/v1/limits", headers={"Authorization": f"Bearer {key}"})
        return r.status_code

    assert limits(ALPHA) == 404 and limits(BETA) == 404
    assert limits(OPERATOR) == 200
