"""Kill -9 (and SIGTERM) mid-batch, restart on the same data dir: nothing lost, nothing twice
(on either store kind: the restarted server takes its own claimed lines back at once).

"Mid-batch" is made exact with the batch line gate (`shoal.server.line_gate`): a few lines'
results are stored, the next lines are answered and held in flight, and then the server is
stopped, on any CPU."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from batch_helpers import HeldLines, chat_line, read_lines, submit_batch, wait_batch
from server_fixtures import STORES, fresh_store
from server_harness import SpawnedServer

N = 24


PARTWAY = 3  # results stored before the interruption
CONCURRENCY = 4  # serve_tiny's batch requests in flight at once


def _batch_partway(srv: SpawnedServer, gate: HeldLines) -> tuple[str, int]:
    """Start a batch of N requests and stop it partway: PARTWAY results stored, a line in
    every batch slot answered and held at the gate. (batch id, how many are stored)."""
    c = srv.client()
    model = c.models.list().data[0].id
    lines = [
        chat_line(f"r{i}", model, f"request number {i}", max_tokens=48, ignore_eos=True)
        for i in range(N)
    ]
    gate.close(let_through=PARTWAY)
    batch_id = str(submit_batch(c, lines).id)
    gate.wait(lambda held: len(held.get(srv.proc.pid, [])) == CONCURRENCY)
    deadline = time.monotonic() + 60
    while (done := _completed(srv, batch_id)) < PARTWAY:
        assert time.monotonic() < deadline, f"only {done} results were stored"
        time.sleep(0.02)
    assert done == PARTWAY
    return batch_id, done


def _completed(srv: SpawnedServer, batch_id: str) -> int:
    counts = srv.client().batches.retrieve(batch_id).request_counts
    return counts.completed if counts else 0


def _check_complete(srv: SpawnedServer, batch_id: str) -> None:
    c = srv.client()
    done = wait_batch(c, batch_id, timeout=120)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (N, 0), done
    out = read_lines(c, done.output_file_id)
    ids = Counter(x["custom_id"] for x in out)
    assert sorted(ids) == sorted(f"r{i}" for i in range(N))
    assert set(ids.values()) == {1}  # nothing duplicated
    assert done.error_file_id is None
    for x in out:
        assert x["response"]["status_code"] == 200
        assert x["response"]["body"]["usage"]["completion_tokens"] == 48


@pytest.mark.parametrize("store_kind", STORES)
def test_kill_and_restart_mid_batch(
    spawn_server: Callable[..., SpawnedServer],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    store_kind: str,
) -> None:
    data = tmp_path / "data"
    url = fresh_store(request, store_kind)
    store = ["--store", url] if url else []
    gate = HeldLines(tmp_path / "gate")
    srv = spawn_server(data, *store, "--batch-gate", str(gate.folder))
    batch_id, before = _batch_partway(srv, gate)
    srv.kill()
    gate.open()
    srv2 = spawn_server(data, *store)
    b = srv2.client().batches.retrieve(batch_id)
    assert b.request_counts is not None and b.request_counts.completed >= before
    _check_complete(srv2, batch_id)


def test_sigterm_checkpoints_and_resumes(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    gate = HeldLines(tmp_path / "gate")
    srv = spawn_server(data, "--batch-gate", str(gate.folder))
    batch_id, _ = _batch_partway(srv, gate)
    # The held lines outlast the grace period: the shutdown aborts them and hands them back.
    # uvicorn re-raises the signal after a clean shutdown, so -SIGTERM is a clean exit too.
    assert srv.terminate() in (0, -15)
    assert "Traceback" not in srv.log.read_text()
    gate.open()
    srv2 = spawn_server(data)
    _check_complete(srv2, batch_id)


def test_sigterm_lets_inflight_streams_finish(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    srv = spawn_server(tmp_path / "data")
    model = srv.client().models.list().data[0].id
    body = {
        "model": model,
        "prompt": "Hello",
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        srv.proc.send_signal(signal.SIGTERM)  # shutdown begins mid-stream
        for line in lines:
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == 150
    assert srv.proc.wait(timeout=60) in (0, -15)
