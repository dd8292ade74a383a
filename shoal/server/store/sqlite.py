"""The single-machine store: one SQLite file (WAL) and a folder of file bytes beside it.

One connection behind a lock per process; writes are `BEGIN IMMEDIATE` transactions, so
several processes on one machine may share the file. File bytes are plain files written
atomically (`shoal.durable.atomic_write`) in `files/` next to the database.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.durable import atomic_write
from shoal.server.jsonl import read_chunks
from shoal.server.store.base import Store, StoreError
from shoal.server.store.sql import Tx

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    expires_at INTEGER,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    obj TEXT NOT NULL,
    tenant TEXT NOT NULL DEFAULT 'default'
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
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    owner TEXT,
    done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS lines_todo ON lines (batch_id, line) WHERE done = 0;
CREATE INDEX IF NOT EXISTS lines_owned ON lines (owner) WHERE done = 0;
CREATE TABLE IF NOT EXISTS replicas (id TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    chain TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    owner TEXT,
    obj TEXT NOT NULL,
    items TEXT NOT NULL,
    turn TEXT,
    events TEXT,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
CREATE INDEX IF NOT EXISTS responses_chain ON responses (chain);
"""
# Columns added since the first release: a data dir written before gains them on open (rows
# from before tenants belong to `default`); then the indexes that need them.
_TENANT = "TEXT NOT NULL DEFAULT 'default'"
_ADDED = (
    ("files", "blob", "TEXT"),
    ("batches", "worker", "TEXT"),
    ("files", "tenant", _TENANT),
    ("batches", "tenant", _TENANT),
    ("responses", "tenant", _TENANT),
)
INDEXES = """
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, seq);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, seq);
"""


class DiskBlobs:
    """File bytes as files in one folder."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.dir.mkdir(parents=True, exist_ok=True)

    def put(self, name: str, content: bytes | Iterable[bytes]) -> int:
        return atomic_write(self.dir / name, content)

    def open(self, name: str) -> Iterator[bytes] | None:
        try:
            f = open(self.dir / name, "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            return None

        def chunks() -> Iterator[bytes]:
            with f:
                yield from read_chunks(f)

        return chunks()

    def delete(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)


class SQLiteStore(Store):
    name = "sqlite"
    NOW = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path, files_dir: Path | None = None) -> None:
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=30
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            for table, column, kind in _ADDED:
                have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            self._db.executescript(INDEXES)
            self.blobs = DiskBlobs(files_dir or self.path.parent / "files")
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open the store {self.url}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Tx]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.OperationalError as e:  # locked past the busy timeout, disk gone
                raise StoreError(f"the store {self.url} failed: {e}") from e
            try:
                yield Tx(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _json(self, field: str) -> str:
        return f"json_extract(obj, '$.{field}')"
