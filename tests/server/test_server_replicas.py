"""Several `shoal serve` processes on one store, each with its own data dir, as replicas run:
a batch created on one runs on all of them with every result written once; kill -9 one
mid-batch and the others finish it, still once; a cancel on one stops them all; Anthropic
message batches ride along; ids that cannot exist are 404s, not database errors.

The replicas share a line gate (`shoal.server.line_gate`): a test that must act while lines
are claimed and in flight closes it, waits until the replicas hold answered lines at it, acts,
and opens it, so what it asserts does not depend on how fast the CPU answers."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from batch_helpers import (
    HeldLines,
    chat_line,
    jsonl,
    read_lines,
    submit_batch,
    upload,
    wait_batch,
)
from server_fixtures import STORES, fresh_store
from server_harness import SpawnedServer

LEASE_S = 2.0
N = 32
TOKENS = 64


@pytest.fixture
def gate(tmp_path: Path) -> HeldLines:
    return HeldLines(tmp_path / "gate")


def shared_store(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> str:
    """A store URL every replica is given (SQLite: one file that processes share)."""
    return fresh_store(request, kind) or f"sqlite:///{tmp_path / 'shared.sqlite3'}"


def replicas(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path, store: str, n: int = 2
) -> list[SpawnedServer]:
    flags = ["--store", store, "--batch-lease-s", str(LEASE_S), "--batch-concurrency", "1"]
    flags += ["--batch-gate", str(tmp_path / "gate")]
    return [spawn_server(tmp_path / f"data-{i}", *flags) for i in range(n)]


def written_by(srv: SpawnedServer) -> int:
    """How many batch results this replica wrote (each result counts where it landed)."""
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    found = re.findall(r'^shoal_batch_requests_total\{outcome="\w+"\} (\S+)$', text, re.M)
    return int(sum(float(x) for x in found))


def start(srv: SpawnedServer, n: int = N) -> str:
    c = srv.client()
    model = c.models.list().data[0].id
    lines = [
        chat_line(f"r{i}", model, f"request number {i}", max_tokens=TOKENS, ignore_eos=True)
        for i in range(n)
    ]
    return str(submit_batch(c, lines).id)


def check_exactly_once(srv: SpawnedServer, batch_id: str, n: int = N) -> None:
    c = srv.client()
    done = wait_batch(c, batch_id, timeout=180)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0), done
    out = read_lines(c, done.output_file_id)
    ids = Counter(x["custom_id"] for x in out)
    assert sorted(ids) == sorted(f"r{i}" for i in range(n)) and set(ids.values()) == {1}
    assert done.error_file_id is None
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == TOKENS for x in out)


def wait_for(what: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def holding(*servers: SpawnedServer) -> Callable[[dict[int, list[str]]], bool]:
    """Every one of `servers` holds an answered line at the gate."""
    return lambda held: all(s.proc.pid in held for s in servers)


@pytest.mark.parametrize("store_kind", STORES)
def test_a_batch_fans_out_over_replicas_and_each_result_lands_once(
    spawn_server: Callable[..., SpawnedServer],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    store_kind: str,
    gate: HeldLines,
) -> None:
    gate.close()
    a, b = replicas(spawn_server, tmp_path, shared_store(request, store_kind, tmp_path))
    batch_id = start(a)
    gate.wait(holding(a, b))  # both replicas claimed and answered lines
    gate.open()
    check_exactly_once(b, batch_id)  # created on A, followed and read on B
    assert written_by(a) > 0 and written_by(b) > 0  # both replicas wrote results
    assert written_by(a) + written_by(b) == N
    out_a = a.client().batches.retrieve(batch_id).output_file_id
    assert (
        out_a and a.client().files.content(out_a).content == b.client().files.content(out_a).content
    )

    # Anthropic's Message Batches run on the same runner and store.
    model = a.client().models.list().data[0].id
    params = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    claude_a, claude_b = (
        anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0) for s in (a, b)
    )
    mb = claude_b.messages.batches.create(
        requests=[{"custom_id": f"m{i}", "params": params} for i in range(6)]
    )
    wait_for(lambda: claude_a.messages.batches.retrieve(mb.id).processing_status == "ended")
    got = [r.custom_id for r in claude_a.messages.batches.results(mb.id)]
    assert sorted(got) == sorted(f"m{i}" for i in range(6))


def test_kill_9_of_a_replica_mid_batch_loses_nothing_and_duplicates_nothing(
    spawn_server: Callable[..., SpawnedServer],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    gate: HeldLines,
) -> None:
    gate.close()
    a, b = replicas(spawn_server, tmp_path, shared_store(request, "postgresql", tmp_path))
    batch_id = start(a)
    gate.wait(holding(a, b))
    (lost,) = gate.by_process()[b.proc.pid]  # B's claimed line, answered, not yet stored
    b.kill()
    assert a.client().batches.retrieve(batch_id).status == "in_progress"  # every answer is held
    gate.open()
    check_exactly_once(a, batch_id)
    assert written_by(a) == N  # the survivor wrote every result, B's claimed line included
    assert lost in {f"r{i}" for i in range(N)}


def test_a_cancel_on_one_replica_stops_the_batch_everywhere(
    spawn_server: Callable[..., SpawnedServer],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    gate: HeldLines,
) -> None:
    gate.close()
    a, b = replicas(spawn_server, tmp_path, shared_store(request, "postgresql", tmp_path))
    batch_id = start(a, n=40)
    gate.wait(holding(a, b))  # both replicas have a line in flight when the cancel lands
    b.client().batches.cancel(batch_id)
    # Aborting a line releases it from the gate: with the gate still closed, nothing held
    # means no line of the batch is left running on either replica.
    gate.wait(lambda held: not held)
    done = wait_batch(a.client(), batch_id, timeout=60)
    assert done.status == "cancelled" and done.cancelled_at
    out = read_lines(a.client(), done.output_file_id)
    errs = read_lines(a.client(), done.error_file_id)
    ids = Counter(x["custom_id"] for x in out + errs)
    assert sorted(ids) == sorted(f"r{i}" for i in range(40)) and set(ids.values()) == {1}
    assert done.request_counts is not None and done.request_counts.completed == len(out)
    assert any(x["error"] and x["error"]["code"] == "batch_cancelled" for x in errs)
    gate.open()
    assert written_by(a) + written_by(b) == len(out)


def test_ids_that_cannot_exist_are_404s(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    (srv,) = replicas(spawn_server, tmp_path, shared_store(request, "postgresql", tmp_path), 1)
    for path in ("/v1/files/%00", "/v1/files/a%00b/content", "/v1/batches/%ED%A0%80"):
        r = httpx.get(f"{srv.url}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    r = httpx.get(f"{srv.url}/v1/messages/batches/{'x' * 5000}")
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = httpx.get(f"{srv.url}/v1/files", params={"after": "\x00"})
    assert r.status_code == 200 and r.json()["data"] == []
    body: dict[str, Any] = {
        "input_file_id": "file-\x00",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    r = httpx.post(f"{srv.url}/v1/batches", json=body)
    assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
    c = srv.client()
    model = c.models.list().data[0].id
    bad = jsonl([chat_line("a\x00b", model, "hi")])
    r = httpx.post(
        f"{srv.url}/v1/files", files={"file": ("in.jsonl", bad)}, data={"purpose": "batch"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_custom_id"
    assert upload(c, jsonl([chat_line("fine", model, "hi")]))  # the store is fine after all


def test_a_store_outage_is_a_503_and_the_batch_ends_once_it_is_back(
    spawn_server: Callable[..., SpawnedServer],
    tmp_path: Path,
    postgres: object,
    gate: HeldLines,
) -> None:
    from pg_harness import local_postgres  # a PostgreSQL of its own, to stop and start

    with local_postgres() as pg:
        gate.close()
        (srv,) = replicas(spawn_server, tmp_path, pg.new_database(), 1)
        batch_id = start(srv, n=16)
        gate.wait(holding(srv))  # an answer computed before the outage, not yet stored
        pg.stop()
        r = httpx.get(f"{srv.url}/v1/batches/{batch_id}", timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert r.headers["retry-after"]
        gate.open()  # the held answer meets the outage: it must wait for the store
        time.sleep(LEASE_S)  # longer than the lease: the server's claims lapse meanwhile
        pg.start()
        check_exactly_once(srv, batch_id, n=16)  # answers computed meanwhile were kept
