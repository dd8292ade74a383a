"""The unmodified `openai` SDK inside a scope against a live `shoal serve`."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import openai
import pytest
from batchify_helpers import batch_ids, chat_kw
from engine_steps import engine_steps
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from server_harness import LiveServer

from shoal.batchify import BatchExpiredError, BatchifyClosedError, batchify

PROMPTS = [f"Hello world {i}" for i in range(7)]


async def test_calls_become_ceil_n_over_batch_size_batches(
    server: LiveServer, aclient: openai.AsyncOpenAI, scope_kw: dict[str, Any]
) -> None:
    direct = [await aclient.chat.completions.create(**chat_kw(server.model, p)) for p in PROMPTS]
    before = set(batch_ids(server.url))
    async with batchify(batch_size=3, **scope_kw) as b:
        got = await asyncio.gather(
            *(aclient.chat.completions.create(**chat_kw(server.model, p)) for p in PROMPTS)
        )
    new = set(batch_ids(server.url)) - before
    assert len(new) == math.ceil(len(PROMPTS) / 3) == b.stats.batches
    for d, g in zip(direct, got, strict=True):
        assert isinstance(g, type(d))
        assert g.choices[0].message.content == d.choices[0].message.content
        assert g.choices[0].finish_reason == d.choices[0].finish_reason
        assert g.usage and d.usage and g.usage.prompt_tokens == d.usage.prompt_tokens
    # Files + batches + polls + result files: far fewer requests than calls.
    assert b.provider_requests < 4 * len(new) + 20


async def test_responses_create_calls_become_one_job(
    server: LiveServer, aclient: openai.AsyncOpenAI, scope_kw: dict[str, Any]
) -> None:
    def kw(i: int) -> dict[str, Any]:
        return {
            "model": server.model,
            "input": f"Hello world {i}",
            "temperature": 0,
            "max_output_tokens": 4,
        }

    direct = [await aclient.responses.create(**kw(i)) for i in range(12)]
    before = set(batch_ids(server.url))
    async with batchify(**scope_kw) as b:
        got = await asyncio.gather(*(aclient.responses.create(**kw(i)) for i in range(12)))
    (batch_id,) = set(batch_ids(server.url)) - before
    assert b.stats.batches == 1 and b.stats.calls == 12
    assert httpx.get(f"{server.url}/v1/batches/{batch_id}").json()["endpoint"] == "/v1/responses"
    for d, g in zip(direct, got, strict=True):
        assert isinstance(g, Response) and g.output_text == d.output_text
        assert g.usage and d.usage and g.usage.input_tokens == d.usage.input_tokens


async def test_parameters_round_trip_unchanged(
    server: LiveServer, aclient: openai.AsyncOpenAI, scope_kw: dict[str, Any]
) -> None:
    extra: dict[str, Any] = {
        "seed": 7,
        "stop": ["\n\n"],
        "top_p": 0.9,
        "user": "u-42",
        "metadata": {"run": "r1"},
        "logit_bias": {"11": -1},
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
    }
    kw = {**chat_kw(server.model, "x"), **extra}
    direct = await aclient.chat.completions.create(**kw)
    before = set(batch_ids(server.url))
    async with batchify(**scope_kw):
        got = await aclient.chat.completions.create(**kw)
    assert got.choices[0].message.content == direct.choices[0].message.content
    (batch_id,) = set(batch_ids(server.url)) - before
    batch = httpx.get(f"{server.url}/v1/batches/{batch_id}").json()
    content = httpx.get(f"{server.url}/v1/files/{batch['input_file_id']}/content").text
    (line,) = [json.loads(ln) for ln in content.splitlines() if ln.strip()]
    assert line["url"] == "/v1/chat/completions"
    assert line["body"] == kw
    assert batch["metadata"]["shoal_batchify_key"]


async def test_models_split_queues_and_errors_reach_only_their_caller(
    server: LiveServer, aclient: openai.AsyncOpenAI, scope_kw: dict[str, Any]
) -> None:
    good = chat_kw(server.model, "Hello world")
    bad_param = chat_kw(server.model, "Hello world", temperature=9)
    other_model = chat_kw("no-such-model", "Hello world")
    expected: list[Any] = []
    for kw in (good, bad_param, other_model):
        try:
            expected.append(await aclient.chat.completions.create(**kw))
        except openai.APIStatusError as e:
            expected.append(e)
    before = set(batch_ids(server.url))
    async with batchify(**scope_kw):
        got = await asyncio.gather(
            *(aclient.chat.completions.create(**kw) for kw in (good, bad_param, other_model)),
            return_exceptions=True,
        )
    assert len(set(batch_ids(server.url)) - before) == 2  # one queue per model
    assert got[0].choices[0].message.content == expected[0].choices[0].message.content
    for e, g in zip(expected[1:], got[1:], strict=True):
        assert type(g) is type(e) and isinstance(g, openai.APIStatusError)
        assert g.status_code == e.status_code
        assert isinstance(g.body, dict) and isinstance(e.body, dict)
        for field in ("type", "param"):
            assert g.body.get(field) == e.body.get(field)


async def test_pass_through_and_closed_scope(
    server: LiveServer, aclient: openai.AsyncOpenAI, scope_kw: dict[str, Any]
) -> None:
    before = set(batch_ids(server.url))
    async with batchify(**scope_kw) as b:
        models = await aclient.models.list()  # GET: no batch equivalent
        stream = await aclient.chat.completions.create(
            **chat_kw(server.model, "Hello world"), stream=True
        )
        chunks = [c async for c in stream]
        await b.aclose()
        await b.aclose()  # idempotent
        with pytest.raises(BatchifyClosedError):
            await aclient.chat.completions.create(**chat_kw(server.model, "late"))
    assert [m.id for m in models.data] == [server.model]
    assert chunks and chunks[0].object == "chat.completion.chunk"
    assert b.stats.calls == 0 and set(batch_ids(server.url)) == before
    # Outside the scope the SDK talks to the server directly again.
    assert (await aclient.chat.completions.create(**chat_kw(server.model, "after"))).choices


async def test_dry_run_touches_nothing(
    server: LiveServer, aclient: openai.AsyncOpenAI, tmp_path: Any
) -> None:
    before = set(batch_ids(server.url))
    files_before = httpx.get(f"{server.url}/v1/files").json()["data"]
    cache = tmp_path / "never.sqlite3"
    async with batchify(dry_run=True, cache_path=cache, window_s=0.05, live_progress=False):
        raw = await aclient.chat.completions.with_raw_response.create(
            **chat_kw(server.model, "Hello")
        )
        emb = await aclient.embeddings.create(model=server.model, input=["a", "b"])
        answer = await aclient.responses.create(model=server.model, input="Hello")
    assert raw.headers["x-shoal-dry-run"] == "1"
    assert isinstance(answer, Response) and answer.output_text == "" and answer.usage
    parsed = raw.parse()
    assert isinstance(parsed, ChatCompletion) and parsed.model == server.model
    assert len(emb.data) == 2
    assert set(batch_ids(server.url)) == before
    assert httpx.get(f"{server.url}/v1/files").json()["data"] == files_before
    assert not cache.exists()


async def test_expired_requests_raise_a_typed_error(
    start_server: Any, scope_kw: dict[str, Any]
) -> None:
    """One request at a time in a 1 s window: the later ones expire, the finished ones
    still come back (output and error files are merged). The engine stops after the first
    request, so the window passes with the rest unfinished, on any CPU."""
    live = start_server(batch_window_s=1, batch_concurrency=1)
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="k", max_retries=0)
    kw = chat_kw(live.model, "Hello", max_tokens=16, extra_body={"ignore_eos": True})
    with engine_steps(live.state.engine) as steps:
        steps.hold(when=lambda: len(steps.finished) >= 1)
        async with batchify(**scope_kw):
            got = await asyncio.gather(
                *(client.chat.completions.create(**{**kw, "seed": i}) for i in range(12)),
                return_exceptions=True,
            )
    expired = [g for g in got if isinstance(g, BatchExpiredError)]
    assert expired and "expired" in str(expired[0])
    assert all(isinstance(g, (BatchExpiredError, ChatCompletion)) for g in got)
