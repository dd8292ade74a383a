"""Completions, chat and streaming through the official `openai` SDK, plus error shapes."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from engine_steps import engine_steps
from server_harness import LiveServer

USER = [{"role": "user", "content": "Hello world, say hello."}]


def test_models(client: openai.OpenAI, server: LiveServer) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_and_stream_agree(client: openai.OpenAI, server: LiveServer) -> None:
    full = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=12, temperature=0, user="u1"
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(
        model=server.model,
        messages=USER,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_and_stream_agree(client: openai.OpenAI, server: LiveServer) -> None:
    full = client.completions.create(
        model=server.model, prompt="The quick brown fox", max_tokens=10, temperature=0
    )
    assert full.object == "text_completion" and full.usage is not None
    stream = client.completions.create(
        model=server.model, prompt="The quick brown fox", max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stream_sse_wire_format(server: LiveServer) -> None:
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_sampling_params(client: openai.OpenAI, server: LiveServer) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=server.model, prompt="Hello", max_tokens=8, temperature=1.0, top_p=0.9, seed=seed
        )
        return r.choices[0].text

    assert sample(7) == sample(7)
    r = client.completions.create(
        model=server.model, prompt=["Hello", "The quick"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: n copies agree
    assert r.usage is not None and 4 <= r.usage.completion_tokens <= 12


def test_stream_with_n_choices(client: openai.OpenAI, server: LiveServer) -> None:
    full = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=6, temperature=0, n=2
    )
    stream = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=6, temperature=0, n=2, stream=True
    )
    texts = ["", ""]
    reasons: list[str | None] = [None, None]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]


def test_stop_strings(client: openai.OpenAI, server: LiveServer) -> None:
    base = (
        client.completions.create(model=server.model, prompt="Hello", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    assert len(base) > 2
    stop = base[2:4]
    cut = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base[: base.index(stop)]
    long_stop = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=16, temperature=0, stop=base[2:9]
    ).choices[0]
    assert long_stop.text == base[: base.index(base[2:9])]


def test_logprobs(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.chat.completions.create(
        model=server.model,
        messages=USER,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    c = client.completions.create(
        model=server.model, prompt="Hi", max_tokens=4, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 4
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    stream = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content or []
    ]
    assert [t.token for t in streamed] == [t.token for t in content]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": "nope"}, openai.NotFoundError),
        ({"temperature": 3.0}, openai.BadRequestError),
        ({"top_p": 0}, openai.BadRequestError),
        ({"max_tokens": 0}, openai.BadRequestError),
        ({"n": 1000}, openai.BadRequestError),
        ({"presence_penalty": 1.0}, openai.BadRequestError),
        ({"messages": []}, openai.BadRequestError),
        ({"messages": [{"role": "wizard", "content": "x"}]}, openai.BadRequestError),
        ({"top_logprobs": 2}, openai.BadRequestError),
        ({"messages": [{"role": "user", "content": "x " * 2000}]}, openai.APIStatusError),
    ],
)
def test_bad_chat_parameters(
    client: openai.OpenAI, server: LiveServer, kwargs: dict[str, object], error: type
) -> None:
    args: dict[str, object] = {"model": server.model, "messages": USER, "max_tokens": 4}
    args.update(kwargs)
    with pytest.raises(error) as info:
        client.chat.completions.create(**args)  # type: ignore[call-overload]
    err = info.value
    assert isinstance(err, openai.APIStatusError)
    assert err.status_code < 500
    body = err.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    if "x " * 10 in str(kwargs):
        assert err.status_code == 400 and body["error"]["code"] == "context_length_exceeded"


def test_raw_error_statuses(server: LiveServer) -> None:
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": server.model, "prompt": ""})
    assert r.status_code == 400
    r = httpx.post(url, json={"model": server.model, "prompt": [99999]})
    assert r.status_code == 400
    r = httpx.post(url, content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_metrics(client: openai.OpenAI, server: LiveServer) -> None:
    client.completions.create(model=server.model, prompt="Hello", max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "shoal_num_requests_running",
        "shoal_num_requests_waiting",
        "shoal_kv_cache_usage_ratio",
        "shoal_generation_tokens_per_second",
        "shoal_time_to_first_token_seconds_bucket",
        "shoal_inter_token_latency_seconds_bucket",
        "shoal_num_preemptions_total",
        "shoal_prefix_cache_hit_rate",
    ):
        assert name in text, name
    # The weights' resident bytes, one gauge per storage format.
    weights = [line for line in text.splitlines() if line.startswith("shoal_model_weight_bytes{")]
    assert weights and all(float(line.split()[-1]) > 0 for line in weights)
    assert all('format="' in line for line in weights)


def test_api_key(start_server: Callable[..., LiveServer]) -> None:
    live = start_server(api_key="sekrit")
    good = live.client(api_key="sekrit")
    assert good.models.list().data
    with pytest.raises(openai.AuthenticationError) as info:
        live.client(api_key="wrong").models.list()
    assert info.value.response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{live.url}/health").status_code == 200  # health stays open
    assert (
        httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Basic sekrit"}).status_code
        == 401
    )


def test_queue_full_is_429(start_server: Callable[..., LiveServer]) -> None:
    live = start_server(engine={"max_waiting": 1})
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    url = f"{live.url}/v1/completions"
    with engine_steps(live.state.engine) as steps, ThreadPoolExecutor(1) as pool:
        steps.hold()  # the first request stays unfinished, on any CPU
        first = pool.submit(httpx.post, url, json=body, timeout=60)
        steps.wait(lambda: len(steps.arrived) == 1)
        r2 = httpx.post(url, json={**body, "max_tokens": 2})
        assert r2.status_code == 429
        assert r2.headers["retry-after"] == "1"
        assert r2.json()["error"]["type"] == "rate_limit_exceeded"
        steps.release()
        assert first.result().status_code == 200


def test_sessions(start_server: Callable[..., LiveServer]) -> None:
    """`session_id` (body) or `X-Session-Id` (header) reaches the engine's sessions."""
    live = start_server()
    url = f"{live.url}/v1/chat/completions"
    body = {"model": live.model, "messages": USER, "max_tokens": 4, "temperature": 0}
    first = httpx.post(url, json={**body, "session_id": "s1"})
    assert first.status_code == 200, first.text
    turn2 = body["messages"] + [
        first.json()["choices"][0]["message"],
        {"role": "user", "content": "again"},
    ]
    second = httpx.post(url, json={**body, "messages": turn2}, headers={"X-Session-Id": "s1"})
    assert second.status_code == 200, second.text
    assert "shoal_session_hits" in httpx.get(f"{live.url}/metrics").text


def test_503_while_shutting_down(start_server: Callable[..., LiveServer]) -> None:
    live = start_server()
    live.state.shutting_down = True  # what SIGTERM sets before uvicorn drains connections
    try:
        r = httpx.post(f"{live.url}/v1/completions", json={"model": live.model, "prompt": "x"})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{live.url}/health").status_code == 503
    finally:
        live.state.shutting_down = False
