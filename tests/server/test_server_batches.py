"""The Batch API through the `openai` SDK: files, batches, round trip, cancel, bad input; on
each store kind (SQLite in the data dir, PostgreSQL)."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from batch_helpers import chat_line, jsonl, read_lines, submit_batch, upload, wait_batch
from engine_steps import engine_steps
from server_fixtures import STORES, fresh_store
from server_harness import LiveServer, wait_pool_whole


@pytest.fixture(scope="module", params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, store_kind: str, start_server: Callable[..., LiveServer]
) -> Iterator[LiveServer]:
    live = start_server(store=fresh_store(request, store_kind))
    yield live
    live.stop()  # before the session's PostgreSQL stops


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture
def start_on_store(
    request: pytest.FixtureRequest, store_kind: str, start_server: Callable[..., LiveServer]
) -> Iterator[Callable[..., LiveServer]]:
    """`start_server` on a fresh store of this module's kind; stopped after the test."""
    started: list[LiveServer] = []

    def start(**kw: object) -> LiveServer:
        started.append(start_server(store=fresh_store(request, store_kind), **kw))
        return started[-1]

    yield start
    for live in started:
        live.stop()


PROMPTS = [
    "Hello world",
    "What is the capital of France?",
    "count to ten",
    "tell a story",
    "The quick brown fox",
    "say hello",
]


def test_round_trip_matches_direct_calls(client: openai.OpenAI, server: LiveServer) -> None:
    lines = [chat_line(f"req-{i}", server.model, p) for i, p in enumerate(PROMPTS)]
    lines.append(
        {
            "custom_id": "cmpl",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "unknown-model", "messages": [{"role": "user", "content": "x"}]},
        }
    )
    lines.append(chat_line("bad-temp", server.model, "x", temperature=9))
    file_id = upload(client, jsonl(lines))
    f = client.files.retrieve(file_id)
    assert f.purpose == "batch" and f.bytes > 0
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "t1"},
    )
    assert batch.status in ("validating", "in_progress")
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (
        done.request_counts.total,
        done.request_counts.completed,
        done.request_counts.failed,
    ) == (len(lines), len(PROMPTS), 2)
    assert done.metadata == {"job": "t1"} and done.model == server.model
    assert done.completed_at and done.in_progress_at and done.finalizing_at

    out = read_lines(client, done.output_file_id)
    errs = read_lines(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(len(PROMPTS)))
    by_id = {x["custom_id"]: x for x in out + errs}
    for line in out:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        assert line["response"]["request_id"]
    for i, p in enumerate(PROMPTS):
        direct = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": p}],
            max_tokens=8,
            temperature=0,
        )
        got = by_id[f"req-{i}"]["response"]["body"]
        assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert got["object"] == "chat.completion"
    assert by_id["cmpl"]["response"]["status_code"] == 404
    assert by_id["cmpl"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id["bad-temp"]["response"]["status_code"] == 400
    out_file = client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
    assert out_file.purpose == "batch_output"


def test_completions_endpoint(client: openai.OpenAI, server: LiveServer) -> None:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": server.model, "prompt": p, "max_tokens": 5, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS[:3])
    ]
    batch = submit_batch(client, lines, endpoint="/v1/completions")
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    out = read_lines(client, done.output_file_id)
    for line in out:
        i = int(line["custom_id"][1:])
        direct = client.completions.create(
            model=server.model, prompt=PROMPTS[i], max_tokens=5, temperature=0
        )
        assert line["response"]["body"]["choices"][0]["text"] == direct.choices[0].text


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
            b"{not json\n",
            "invalid_json_line",
        ),
        (
            b'{"method": "POST", "url": "/v1/chat/completions", "body": {}}\n',
            "missing_required_parameter",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}\n',
            "invalid_url",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n',
            "duplicate_custom_id",
        ),
        (
            b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n',
            "invalid_method",
        ),
        (b"[1, 2]\n", "invalid_json_line"),
        (b"\n\n", "empty_file"),
        (b"\xff\xfe", None),
    ],
)
def test_malformed_jsonl_rejected(client: openai.OpenAI, content: bytes, code: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        upload(client, content)
    err = info.value.response.json()["error"]
    assert err["param"] == "file"
    if code is not None:
        assert err["code"] == code
        assert "line" in err["message"] or code == "empty_file"


def test_mismatched_endpoint_fails_batch(client: openai.OpenAI, server: LiveServer) -> None:
    lines = [
        chat_line("a", server.model, "hi"),
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": server.model, "prompt": "x"},
        },
    ]
    batch = submit_batch(client, lines)
    done = wait_batch(client, batch.id)
    assert done.status == "failed" and done.failed_at
    assert done.errors is not None and done.errors.data
    assert done.errors.data[0].line == 2 and done.errors.data[0].code == "mismatched_url"


def test_bad_batch_requests(client: openai.OpenAI, server: LiveServer) -> None:
    file_id = upload(client, jsonl([chat_line("a", server.model, "hi")]))
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h"
        )  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.txt", io.BytesIO(b"hi")), purpose="nonsense")  # type: ignore[arg-type]


def test_files_crud(client: openai.OpenAI, server: LiveServer) -> None:
    data = jsonl([chat_line("a", server.model, "hi")])
    ids = [upload(client, data, f"f{i}.jsonl") for i in range(3)]
    listed = [f.id for f in client.files.list(purpose="batch", limit=100)]
    assert all(i in listed for i in ids)
    assert listed.index(ids[2]) < listed.index(ids[0])  # newest first
    assert client.files.content(ids[0]).content == data
    assert client.files.retrieve(ids[1]).filename == "f1.jsonl"
    deleted = client.files.delete(ids[1])
    assert deleted.deleted and deleted.id == ids[1]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(ids[1])


def test_list_batches_paginates(client: openai.OpenAI, server: LiveServer) -> None:
    file_id = upload(client, jsonl([chat_line("a", server.model, "hi", max_tokens=1)]))
    made = [
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(5)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    seen = [b.id for b in client.batches.list(limit=2)]  # auto-paginates with `after`
    assert Counter(seen)[made[0]] == 1 and all(m in seen for m in made)
    for b in made:
        wait_batch(client, b)


def test_cancel(start_on_store: Callable[..., LiveServer]) -> None:
    live = start_on_store(batch_concurrency=2, engine={"max_num_seqs": 2})
    c = live.client()
    lines = [
        chat_line(f"r{i}", live.model, "count to ten", max_tokens=32, ignore_eos=True)
        for i in range(20)
    ]
    with engine_steps(live.state.engine) as steps:
        # The engine stops once a line has finished: the cancel lands with the next lines
        # in the engine, whatever the CPU's speed.
        steps.hold(when=lambda: len(steps.finished) >= 1)
        batch = submit_batch(c, lines)
        steps.wait(lambda: len(steps.finished) >= 1 and len(steps.arrived) >= 3)
        finished_before = len(steps.finished)
        cancelling = c.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_batch(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    out = read_lines(c, done.output_file_id)
    errs = read_lines(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in out + errs) == sorted(f"r{i}" for i in range(20))
    assert any(x["error"] and x["error"]["code"] == "batch_cancelled" for x in errs)
    assert done.request_counts is not None and done.request_counts.completed == len(out)
    assert len(out) <= finished_before  # only lines that finished before the cancel
    assert wait_pool_whole(live)  # the lines in flight were aborted
    with pytest.raises(openai.BadRequestError):
        c.batches.cancel(wait_batch(c, submit_batch(c, lines[:1]).id).id)


def test_expiry(start_on_store: Callable[..., LiveServer]) -> None:
    live = start_on_store(batch_concurrency=1, batch_window_s=1, engine={"max_num_seqs": 1})
    c = live.client()
    lines = [
        chat_line(f"r{i}", live.model, "count", max_tokens=16, ignore_eos=True) for i in range(30)
    ]
    with engine_steps(live.state.engine) as steps:
        # One line finishes, then the engine stops until the window has passed.
        steps.hold(when=lambda: len(steps.finished) >= 1)
        batch = submit_batch(c, lines)
        done = wait_batch(c, batch.id)
    assert done.status == "expired" and done.expired_at
    out = read_lines(c, done.output_file_id)
    errs = read_lines(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in out + errs) == sorted(f"r{i}" for i in range(30))
    expired = [x for x in errs if x["error"] and x["error"]["code"] == "batch_expired"]
    assert expired and all(x["response"] is None for x in expired)
    assert done.request_counts is not None and done.request_counts.completed == len(out)
    assert wait_pool_whole(live)


def test_interactive_overtakes_batch(start_on_store: Callable[..., LiveServer]) -> None:
    """Batch lines wait in the engine at priority 1; an interactive request (priority 0)
    goes ahead of them instead of queueing behind."""
    live = start_on_store(batch_concurrency=4, engine={"max_num_seqs": 1})
    c = live.client()
    lines = [
        chat_line(f"r{i}", live.model, "count", max_tokens=16, ignore_eos=True) for i in range(8)
    ]
    with engine_steps(live.state.engine) as steps, ThreadPoolExecutor(1) as pool:
        steps.hold()
        batch = submit_batch(c, lines)
        steps.wait(lambda: len(steps.ids(priority=1)) == 4)
        steps.step_once()  # one line starts (one sequence at a time), three stay queued
        asked = pool.submit(
            c.chat.completions.create,
            model=live.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
        )
        steps.wait(lambda: len(steps.ids(priority=0)) == 1)
        steps.release()
        asked.result()
        steps.wait(lambda: steps.ids(priority=0)[0] in steps.finished)
        ahead = steps.finished.index(steps.ids(priority=0)[0])
    # Queued behind, it would have waited for the running line and the three queued ones.
    assert ahead <= 1, steps.finished
    assert wait_batch(c, batch.id).status == "completed"
