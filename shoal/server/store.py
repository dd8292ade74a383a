"""Durable state: SQLite (WAL) for files, batches and per-request batch results, plus a folder
holding file contents. One connection behind a lock; every call is a short transaction.

Batch results are keyed by `(batch_id, custom_id)` and inserted with `INSERT OR IGNORE`, so a
request finished twice (a restart racing a write) is stored once; output files are built
from this table, never from memory.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from shoal.durable import atomic_write
from shoal.server.ids import new_id

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    obj TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    body TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, custom_id)
);
"""


def _file_obj(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": row["expires_at"],
        "status_details": None,
    }


class Store:
    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.dir / "shoal.sqlite3", check_same_thread=False, isolation_level=None
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- files -----------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def create_file(
        self,
        filename: str,
        purpose: str,
        content: bytes | Iterable[bytes],
        *,
        file_id: str | None = None,
        expires_at: int | None = None,
    ) -> dict[str, Any]:
        """Store `content` (bytes, or chunks streamed to disk) whole, then record it."""
        file_id = file_id or new_id("file-")
        size = atomic_write(self.file_path(file_id), content)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO files "
                "(id, bytes, created_at, filename, purpose, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, size, int(time.time()), filename, purpose, expires_at),
            )
        obj = self.get_file(file_id)
        assert obj is not None
        return obj

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        rows = self._q("SELECT * FROM files WHERE id = ?", (file_id,))
        return _file_obj(rows[0]) if rows else None

    def list_files(
        self, *, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        desc = order == "desc"
        sql, args = "SELECT * FROM files WHERE 1=1", list[Any]()
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:
            sql += f" AND seq {'<' if desc else '>'} (SELECT seq FROM files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"
        args.append(limit + 1)
        rows = self._q(sql, tuple(args))
        return [_file_obj(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)
        return cur.rowcount > 0

    # -- batches ---------------------------------------------------------------------------
    def create_batch(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, status, obj) VALUES (?, ?, ?)",
                (obj["id"], obj["status"], json.dumps(obj)),
            )

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        rows = self._q("SELECT obj FROM batches WHERE id = ?", (batch_id,))
        return json.loads(rows[0]["obj"]) if rows else None

    def update_batch(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT obj FROM batches WHERE id = ?", (batch_id,))
                obj = json.loads(row.fetchone()["obj"])
                obj.update(fields)
                self._db.execute(
                    "UPDATE batches SET status = ?, obj = ? WHERE id = ?",
                    (obj["status"], json.dumps(obj), batch_id),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return obj

    def list_batches(
        self,
        *,
        after: str | None = None,
        before: str | None = None,
        limit: int,
        endpoints: tuple[str, ...] | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first: those older than `after`, or the `limit` just newer than `before`;
        only batches of `endpoints` when given (OpenAI and Anthropic lists stay apart)."""
        where, args = ["1=1"], list[Any]()
        if endpoints:
            where.append(f"json_extract(obj, '$.endpoint') IN ({','.join('?' * len(endpoints))})")
            args += endpoints
        if after:
            where.append("seq < (SELECT seq FROM batches WHERE id = ?)")
            args.append(after)
        if before:
            where.append("seq > (SELECT seq FROM batches WHERE id = ?)")
            args.append(before)
        order = "ASC" if before and not after else "DESC"
        sql = f"SELECT obj FROM batches WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?"
        rows = self._q(sql, (*args, limit + 1))
        page = [json.loads(r["obj"]) for r in rows[:limit]]
        return (page[::-1] if order == "ASC" else page), len(rows) > limit

    def delete_batch(self, batch_id: str) -> None:
        """Forget a finished batch and its results (its files are the caller's to delete)."""
        with self._lock:
            self._db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
            self._db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))

    def batch_ids(self, statuses: Iterable[str]) -> list[str]:
        """Batches in one of `statuses`, oldest first."""
        wanted = tuple(statuses)
        marks = ",".join("?" * len(wanted))
        rows = self._q(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", wanted)
        return [r["id"] for r in rows]

    def batches_using_file(self, file_id: str, statuses: Iterable[str]) -> list[str]:
        wanted = tuple(statuses)
        marks = ",".join("?" * len(wanted))
        rows = self._q(
            f"SELECT id FROM batches WHERE status IN ({marks}) "
            "AND json_extract(obj, '$.input_file_id') = ?",
            (*wanted, file_id),
        )
        return [r["id"] for r in rows]

    # -- batch results ---------------------------------------------------------------------
    def add_result(
        self,
        batch_id: str,
        custom_id: str,
        line: int,
        ok: bool,
        body: dict[str, Any],
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> bool:
        """Record one finished request; False if it was already recorded."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    custom_id,
                    line,
                    int(ok),
                    json.dumps(body),
                    prompt_tokens,
                    completion_tokens,
                ),
            )
        return cur.rowcount > 0

    def done_custom_ids(self, batch_id: str) -> set[str]:
        return {
            r[0] for r in self._q("SELECT custom_id FROM results WHERE batch_id = ?", (batch_id,))
        }

    def result_counts(self, batch_id: str) -> tuple[int, int, int, int]:
        """(completed, failed, prompt_tokens, completion_tokens)."""
        row = self._q(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
            "FROM results WHERE batch_id = ?",
            (batch_id,),
        )[0]
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])

    def results(self, batch_id: str) -> Iterator[tuple[bool, str]]:
        rows = self._q("SELECT ok, body FROM results WHERE batch_id = ? ORDER BY line", (batch_id,))
        for r in rows:
            yield bool(r["ok"]), r["body"]
