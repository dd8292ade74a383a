"""The SQLite ledger, delays between polls, and the progress board, without a server."""

from __future__ import annotations

import io
import logging
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest
from rich.console import Console

from shoal.batchify.cache import Cache, Intent
from shoal.batchify.poll import Backoff, Pacer, retry_after_s
from shoal.batchify.progress import Board, LiveProgress, Row, make_progress


def _intent(tag: str, created_at: float, batch_id: str | None = None) -> Intent:
    return Intent(tag, "openai", "http://x/v1", "/v1/chat/completions", 2, created_at, batch_id)


def test_ledger_intent_record_forget_and_age(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    cache = Cache(path)
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cache.write_intent(_intent("t1", time.time()), [("k1", "sb-t1-0"), ("k2", "sb-t1-1")])
    found = cache.lookup(["k1", "k2", "k3"])
    assert set(found) == {"k1", "k2"} and found["k2"].custom_id == "sb-t1-1"
    assert found["k1"].intent.batch_id is None  # intent only: a crash before the record
    cache.record("t1", "batch_1")
    cache.close()

    cache = Cache(path)  # what a re-run sees
    assert cache.lookup(["k1"])["k1"].intent.batch_id == "batch_1"
    cache.forget("t1")
    assert cache.lookup(["k1", "k2"]) == {}
    cache.write_intent(_intent("old", time.time() - 3600), [("k9", "sb-old-0")])
    assert cache.clean(max_age_s=60) == 1 and cache.lookup(["k9"]) == {}
    cache.close()


def test_a_failed_intent_write_leaves_nothing(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c.sqlite3")
    cache.write_intent(_intent("t1", time.time()), [("k1", "sb-t1-0")])
    with pytest.raises(sqlite3.IntegrityError):  # the same tag twice: rolled back whole
        cache.write_intent(_intent("t1", time.time()), [("k2", "sb-t1-0")])
    assert set(cache.lookup(["k1", "k2"])) == {"k1"}
    cache.close()


def test_backoff_grows_to_its_cap_and_retry_after_wins() -> None:
    b = Backoff(1.0, 3.0, factor=2.0)
    assert [b.next_delay() for _ in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert b.next_delay(retry_after_s=10.0) == 10.0
    assert b.next_delay(retry_after_s=0.5) == 3.0


def test_polls_wait_for_the_projected_end_once_progress_shows() -> None:
    pacer = Pacer(Backoff(1.0, 300.0, factor=1.5))
    assert pacer.next_delay(done=0, total=1000, now=0.0) == 1.0
    assert pacer.next_delay(done=0, total=1000, now=1.0) == 1.5  # no progress yet
    # 100 done in 10 s: 900 more take about 90 s.
    assert pacer.next_delay(done=100, total=1000, now=10.0) == pytest.approx(90.0)
    late = Pacer(Backoff(1.0, 30.0))
    late.next_delay(0, 1000, now=0.0)
    assert late.next_delay(1, 1000, now=10.0) == 30.0  # never past the cap


def test_retry_after_forms() -> None:
    assert retry_after_s({"retry-after": "2"}) == 2.0
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    now = datetime(2030, 1, 1, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert retry_after_s({"retry-after": later}, now=now.timestamp()) == pytest.approx(30)
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({}) is None


def test_progress_logs_state_changes_and_renders_a_live_table(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = make_progress(live=False)
    plain.batch("t", "openai /v1/chat/completions", 4)
    with caplog.at_level(logging.INFO, logger="shoal.batchify"):
        plain.update("t", state="submitted", batch_id="batch_9")
        plain.update("t", state="submitted", done=1)  # no state change: no line
        plain.update("t", state="done", done=4)
    assert [r.getMessage().split(": ")[-1] for r in caplog.records] == ["submitted 0/4", "done 4/4"]
    live = make_progress(live=True)
    assert isinstance(live, LiveProgress)
    live.queued(2)
    live.batch("t", "anthropic /v1/messages", 3)
    live.update("t", state="in progress", batch_id="msgbatch_1", done=1)
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(live._render())
    live.close()
    text = console.export_text()
    assert "2 queued" in text and "msgbatch_1" in text and "in progress" in text


def test_progress_never_goes_backwards() -> None:
    board = Board(rows={"t": Row("openai /v1/chat/completions", 10)})
    board.update("t", state="in progress", done=6, failed=1)
    row, changed = board.update("t", state="in progress", done=0, failed=0)
    assert (row.done, row.failed, changed) == (6, 1, False)
