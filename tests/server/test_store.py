"""The batch store, the same on SQLite and PostgreSQL: files stream whole, status changes are
compare-and-set, a result is written once and only while its batch runs, claims on lines lapse
with their replica's heartbeat, one replica finalizes, unknown or corrupt ids are just unknown,
and a store that cannot be opened says why."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from server_harness import free_port

from shoal.server.store import BatchStatus, OutputFile, Store, StoreError, open_store
from shoal.urls import redact


def new_batch(store: Store, batch_id: str, status: str = BatchStatus.IN_PROGRESS) -> str:
    obj = {"id": batch_id, "status": status, "endpoint": "/v1/completions"}
    store.create_batch({**obj, "input_file_id": "file-x", "expires_at": None}, tenant="default")
    return batch_id


def result(store: Store, batch_id: str, custom_id: str, line: int = 1) -> bool:
    return store.add_result(batch_id, custom_id, line, True, {"custom_id": custom_id}, 3, 5)


def read(store: Store, file_id: str) -> bytes | None:
    chunks = store.read_file(file_id, tenant=None)
    return None if chunks is None else b"".join(chunks)


def test_files_stream_whole_in_any_chunks(store: Store) -> None:
    data = bytes(range(256)) * 9000  # 2.2 MiB: several 1 MiB chunks in the database
    pieces = [data[i : i + 700_001] for i in range(0, len(data), 700_001)]
    big = store.create_file("big.jsonl", "batch", iter(pieces), tenant="default")
    empty = store.create_file("empty.jsonl", "user_data", b"", tenant="default")
    assert big["bytes"] == len(data) and empty["bytes"] == 0
    assert read(store, big["id"]) == data and read(store, empty["id"]) == b""
    listed, more = store.list_files(
        tenant="default", purpose=None, after=None, limit=10, order="desc"
    )
    assert [f["id"] for f in listed] == [empty["id"], big["id"]] and not more
    page, more = store.list_files(
        tenant="default", purpose="batch", after=None, limit=10, order="asc"
    )
    assert [f["id"] for f in page] == [big["id"]] and not more
    assert store.delete_file(big["id"], tenant=None)
    assert not store.delete_file(big["id"], tenant=None)
    assert store.get_file(big["id"], tenant=None) is None and read(store, big["id"]) is None


@pytest.mark.parametrize("bad", ["", "a\x00b", "\ud800", "x" * 5000, "../../etc/passwd"])
def test_corrupt_or_unknown_ids_are_unknown(store: Store, bad: str) -> None:
    assert store.get_file(bad, tenant=None) is None and store.read_file(bad, tenant=None) is None
    assert store.get_batch(bad, tenant=None) is None and not store.delete_file(bad, tenant=None)
    listed = store.list_files(tenant="default", purpose=None, after=bad, limit=5, order="desc")
    assert listed == ([], False)
    assert store.list_batches(tenant="default", after=bad, limit=5) == ([], False)


def test_status_changes_are_compare_and_set(store: Store) -> None:
    new_batch(store, "batch_a", BatchStatus.VALIDATING)
    started = store.update_batch(
        "batch_a", expect=(BatchStatus.VALIDATING,), status=BatchStatus.IN_PROGRESS, model="m"
    )
    assert started is not None and started["model"] == "m"
    again = store.update_batch(
        "batch_a", expect=(BatchStatus.VALIDATING,), status=BatchStatus.FAILED
    )
    assert again is None  # a second validator lost: nothing changed
    got = store.get_batch("batch_a", tenant=None)
    assert got is not None and got["status"] == BatchStatus.IN_PROGRESS and got["model"] == "m"
    assert store.update_batch("batch_nope", status=BatchStatus.FAILED) is None


def test_a_result_is_written_once_and_only_while_in_progress(store: Store) -> None:
    new_batch(store, "batch_r")
    store.add_lines("batch_r", [("a", 1), ("b", 2), ("c", 3)])
    assert result(store, "batch_r", "a") and not result(store, "batch_r", "a")
    assert store.lines_left("batch_r") == 2
    store.update_batch("batch_r", status=BatchStatus.CANCELLING)
    assert not result(store, "batch_r", "b", 2)  # cancelled: the late answer is not wanted
    assert store.result_counts("batch_r") == (1, 0, 3, 5)
    assert store.done_custom_ids("batch_r") == {"a"}


def test_claims_lapse_with_their_replicas_heartbeat(store: Store) -> None:
    new_batch(store, "batch_c")
    keys = [(f"r{i}", i + 1) for i in range(6)]
    store.add_lines("batch_c", keys)
    store.add_lines("batch_c", keys)  # every replica records them: once is what counts
    store.heartbeat("A", 0.5)
    store.heartbeat("B", 30)
    a = store.claim_lines("batch_c", "A", 4)
    b = store.claim_lines("batch_c", "B", 4)
    assert a == ["r0", "r1", "r2", "r3"] and b == ["r4", "r5"]  # in file order, no overlap
    assert store.claim_lines("batch_c", "B", 4) == []  # A is alive: its lines stay its own
    assert result(store, "batch_c", "r0") and result(store, "batch_c", "r1", 2)
    time.sleep(0.7)  # A's heartbeat lapses (it died)
    assert store.claim_lines("batch_c", "B", 4) == ["r2", "r3"]
    store.release_lines("B", "batch_c")  # a clean stop hands lines back at once
    store.heartbeat("C", 30)
    assert store.claim_lines("batch_c", "C", 10) == ["r2", "r3", "r4", "r5"]
    assert store.lines_left("batch_c") == 4


def test_concurrent_claims_never_hand_a_line_out_twice(store: Store) -> None:
    new_batch(store, "batch_p")
    store.add_lines("batch_p", [(f"r{i}", i) for i in range(200)])
    taken: list[str] = []
    lock = threading.Lock()

    def replica(name: str) -> None:
        store.heartbeat(name, 60)
        while got := store.claim_lines("batch_p", name, 3):
            with lock:
                taken.extend(got)

    threads = [threading.Thread(target=replica, args=(f"R{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(taken) == 200 and set(Counter(taken).values()) == {1}


def test_one_replica_finalizes_and_the_files_land_with_the_status(store: Store) -> None:
    new_batch(store, "batch_f")
    store.add_lines("batch_f", [("a", 1), ("b", 2)])
    store.heartbeat("A", 0.5)
    store.heartbeat("B", 30)
    closing: dict[str, Any] = {"status": BatchStatus.FINALIZING}
    assert store.update_batch("batch_f", worker="A", when_lines_done=True, **closing) is None
    assert result(store, "batch_f", "a") and result(store, "batch_f", "b", 2)
    assert store.update_batch("batch_f", worker="A", when_lines_done=True, **closing)
    assert not store.claim_finalizer("batch_f", "B")  # A is finalizing and alive
    out = [OutputFile("file-fo", "batch_f_output.jsonl", b'{"x": 1}\n')]
    done: dict[str, Any] = {"status": BatchStatus.COMPLETED, "output_file_id": "file-fo"}
    assert store.finish_batch("batch_f", "B", out, **done) is None
    assert store.get_file("file-fo", tenant=None) is None  # the loser's file never appears
    time.sleep(0.7)  # A died mid-finalization
    assert store.claim_finalizer("batch_f", "B")
    ended = store.finish_batch("batch_f", "B", out, **done)
    assert ended is not None and ended["status"] == BatchStatus.COMPLETED
    assert read(store, "file-fo") == b'{"x": 1}\n'
    assert store.finish_batch("batch_f", "B", out, **done) is None  # once
    assert store.batch_ids([BatchStatus.FINALIZING]) == []


def test_a_data_dir_from_before_the_store_interface_opens(tmp_path: Path) -> None:
    """The first release's schema (no claims, file bytes at `files/<id>.jsonl`): its files
    read, and a batch it left running resumes with only its missing lines."""
    db = sqlite3.connect(tmp_path / "shoal.sqlite3")
    db.executescript(
        "CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,"
        " bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, filename TEXT NOT NULL,"
        " purpose TEXT NOT NULL, expires_at INTEGER);"
        "CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,"
        " status TEXT NOT NULL, obj TEXT NOT NULL);"
        "CREATE TABLE results (batch_id TEXT NOT NULL, custom_id TEXT NOT NULL,"
        " line INTEGER NOT NULL, ok INTEGER NOT NULL, body TEXT NOT NULL,"
        " prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,"
        " PRIMARY KEY (batch_id, custom_id));"
        "INSERT INTO files VALUES (1, 'file-old', 3, 0, 'in.jsonl', 'batch', NULL);"
        "INSERT INTO batches VALUES (1, 'batch_old', 'in_progress', '{\"id\": \"batch_old\","
        ' "status": "in_progress", "input_file_id": "file-old"}\');'
        "INSERT INTO results VALUES ('batch_old', 'a', 1, 1, '{}', 0, 0);"
    )
    db.commit()
    db.close()
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "file-old.jsonl").write_bytes(b"abc")
    store = open_store(f"sqlite:///{tmp_path / 'shoal.sqlite3'}")
    assert read(store, "file-old") == b"abc"
    store.add_lines("batch_old", [("a", 1), ("b", 2)])
    store.heartbeat("A", 30)
    assert store.claim_lines("batch_old", "A", 5) == ["b"]
    store.close()


def test_a_store_that_cannot_be_opened_says_why(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"cannot open the store sqlite:///.*missing"):
        open_store(f"sqlite:///{tmp_path}/missing/dir/shoal.db")
    with pytest.raises(StoreError, match="unknown store URL"):
        open_store("mysql://localhost/shoal")
    started = time.monotonic()
    url = f"postgresql://shoal:secret@127.0.0.1:{free_port()}/shoal"
    with pytest.raises(StoreError) as info:
        open_store(url)  # nothing listens there
    assert "cannot open the store" in str(info.value) and "secret" not in str(info.value)
    assert time.monotonic() - started < 15
    assert redact(url) == url.replace("secret", "***")


def test_only_a_postgresql_store_imports_psycopg(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from shoal.server.app import create_app\n"
        "from shoal.server.store import open_store\n"
        "open_store(sys.argv[1]).close()\n"
        "assert not [m for m in sys.modules if m.startswith('psycopg')]\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s.db")], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_serve_with_a_store_it_cannot_open_stops_before_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoal.cli import main

    store = f"postgresql://shoal:secret@127.0.0.1:{free_port()}/shoal"
    argv = ["serve", "--model", str(tmp_path / "no-model"), "--data-dir", str(tmp_path / "d")]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--store", store])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("shoal serve: cannot open the store")
    assert err.count("\n") == 1 and "secret" not in err
    assert main([*argv, "--batch-lease-s", "0"]) == 2
