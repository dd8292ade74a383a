"""Every stored object is its tenant's, on SQLite and PostgreSQL: another tenant cannot get,
read, list or delete it, nor use its id as a list cursor (a page that tells nothing), a
batch's output files are its tenant's, and a store written before tenants opens with all its
rows owned by `default`."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

from shoal.server.store import BatchStatus, OutputFile, Store, open_store
from shoal.server.store import postgres as pg_store
from shoal.server.store import sqlite as sqlite_store
from shoal.server.store.responses import StoredResponse


def batch(store: Store, batch_id: str, tenant: str, file_id: str = "file-x") -> None:
    obj = {"id": batch_id, "status": BatchStatus.IN_PROGRESS, "endpoint": "/v1/completions"}
    store.create_batch({**obj, "input_file_id": file_id, "expires_at": None}, tenant=tenant)


def test_files_are_their_tenants(store: Store) -> None:
    a = store.create_file("a.jsonl", "batch", b"A\n", tenant="alpha")
    b = store.create_file("b.jsonl", "batch", b"B\n", tenant="beta")
    assert store.get_file(a["id"], tenant="beta") is None
    assert store.read_file(a["id"], tenant="beta") is None
    assert not store.delete_file(a["id"], tenant="beta")
    mine, _ = store.list_files(tenant="alpha", purpose=None, after=None, limit=10, order="desc")
    assert [f["id"] for f in mine] == [a["id"]]
    # Another tenant's id as a cursor is no cursor at all: nothing tells it exists.
    for order in ("asc", "desc"):
        page = store.list_files(tenant="beta", purpose=None, after=a["id"], limit=9, order=order)
        assert page == ([], False)
    assert store.get_file(a["id"], tenant="alpha") == a
    assert store.delete_file(b["id"], tenant="beta")
    assert store.get_file(a["id"], tenant=None) is not None  # the server's own reads see all


def test_batches_and_their_output_are_their_tenants(store: Store) -> None:
    batch(store, "batch_a", "alpha")
    batch(store, "batch_b", "beta")
    assert store.get_batch("batch_a", tenant="beta") is None
    assert store.batch_tenant("batch_a") == "alpha"
    listed, _ = store.list_batches(tenant="beta", limit=10)
    assert [b["id"] for b in listed] == ["batch_b"]
    assert store.list_batches(tenant="beta", after="batch_a", limit=10) == ([], False)
    assert store.list_batches(tenant="beta", before="batch_a", limit=10) == ([], False)
    store.heartbeat("R", 30)
    store.update_batch("batch_a", status=BatchStatus.FINALIZING, worker="R")
    out = [OutputFile("file-out", "batch_a_output.jsonl", b"{}\n")]
    assert store.finish_batch("batch_a", "R", out, status=BatchStatus.COMPLETED)
    assert store.get_file("file-out", tenant="alpha") is not None
    assert store.get_file("file-out", tenant="beta") is None


def test_responses_are_their_tenants(store: Store) -> None:
    obj: dict[str, Any] = {"id": "resp_a", "status": "completed"}
    record = StoredResponse("resp_a", "resp_a", "completed", obj, tenant="alpha")
    store.add_response(record, keep=100, max_age_s=1e9)
    assert store.get_response("resp_a", tenant="beta") is None
    assert store.delete_response("resp_a", tenant="beta") is None
    got = store.get_response("resp_a", tenant="alpha")
    assert got is not None and got.tenant == "alpha"


def _before_tenants(schema: str) -> str:
    """The schema as the release before tenants created it."""
    schema = re.sub(r",\n\s*tenant TEXT NOT NULL DEFAULT 'default'", "", schema)
    return "\n".join(ln for ln in schema.splitlines() if "tenant" not in ln)


OLD_ROWS = [
    "INSERT INTO files (id, bytes, created_at, filename, purpose) VALUES "
    "('file-old', 0, 1, 'old.jsonl', 'batch')",
    "INSERT INTO batches (id, status, obj) VALUES ('batch_old', 'completed', '{\"id\": 1}')",
    "INSERT INTO responses (id, chain, created_at, status, obj, items) VALUES "
    "('resp_old', 'resp_old', 1, 'completed', '{}', '[]')",
]


def _check_old_rows(store: Store) -> None:
    assert store.get_file("file-old", tenant="default") is not None
    assert store.get_file("file-old", tenant="alpha") is None
    assert store.batch_tenant("batch_old") == "default"
    assert store.get_response("resp_old", tenant="default") is not None
    files, _ = store.list_files(tenant="default", purpose=None, after=None, limit=5, order="asc")
    assert [f["id"] for f in files] == ["file-old"]


def test_a_sqlite_store_from_before_tenants_is_the_default_tenants(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_before_tenants(sqlite_store.SCHEMA))
        for row in OLD_ROWS:
            db.execute(row)
    store = open_store(path)
    try:
        _check_old_rows(store)
    finally:
        store.close()


def test_a_postgres_store_from_before_tenants_is_the_default_tenants(postgres: Any) -> None:
    import psycopg

    url = postgres.new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_before_tenants(pg_store.SCHEMA).encode())
        for row in OLD_ROWS:
            conn.execute(row.encode())
    store = open_store(url)
    try:
        _check_old_rows(store)
    finally:
        store.close()
