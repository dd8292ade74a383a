"""The crash-safety ledger: SQLite (WAL), written before any batch is submitted.

An *intent* (its tag, target, size and time) and the request keys it covers are committed
before the provider hears of the batch; the batch id is added once the provider answers. So
after a crash at any point a re-run finds each request in one of three states: unknown
(submit it), intent without id (look for the orphan by its tag, adopt it or submit again), or
intent with id (resume polling). Calls are blocking and short; the batcher runs them in a
worker thread, never on its event loop.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS intents (
    tag TEXT PRIMARY KEY,
    adapter TEXT NOT NULL,
    base_url TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    n INTEGER NOT NULL,
    created_at REAL NOT NULL,
    batch_id TEXT
);
CREATE TABLE IF NOT EXISTS requests (
    request_key TEXT PRIMARY KEY,
    tag TEXT NOT NULL REFERENCES intents(tag) ON DELETE CASCADE,
    custom_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_by_tag ON requests(tag);
"""
DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0  # providers delete batch files after 30 days
_CHUNK = 500  # SQLite's bound-parameter limit is far above this on every build


def default_cache_path() -> Path:
    env = os.environ.get("SHOAL_BATCHIFY_CACHE")
    if env:
        return Path(env)
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "shoal" / "batchify.sqlite3"


@dataclass(slots=True)
class Intent:
    tag: str
    adapter: str
    base_url: str
    endpoint: str
    n: int
    created_at: float
    batch_id: str | None = None


@dataclass(slots=True)
class Cached:
    custom_id: str
    intent: Intent


class Cache:
    def __init__(self, path: Path, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: an intent must be on disk before the provider call it guards.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self.clean(max_age_s)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def lookup(self, keys: list[str]) -> dict[str, Cached]:
        found: dict[str, Cached] = {}
        with self._lock:
            for i in range(0, len(keys), _CHUNK):
                chunk = keys[i : i + _CHUNK]
                rows = self._db.execute(
                    "SELECT r.request_key, r.custom_id, i.tag, i.adapter, i.base_url, "
                    "i.endpoint, i.n, i.created_at, i.batch_id FROM requests r "
                    f"JOIN intents i ON i.tag = r.tag WHERE r.request_key IN "
                    f"({','.join('?' * len(chunk))})",
                    chunk,
                ).fetchall()
                for key, cid, *intent in rows:
                    found[key] = Cached(cid, Intent(*intent))
        return found

    def write_intent(self, intent: Intent, rows: list[tuple[str, str]]) -> None:
        """Commit the intent and its (request_key, custom_id) rows in one transaction."""
        with self._lock, self._tx():
            self._db.execute(
                "INSERT INTO intents VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    intent.tag,
                    intent.adapter,
                    intent.base_url,
                    intent.endpoint,
                    intent.n,
                    intent.created_at,
                    intent.batch_id,
                ),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO requests VALUES (?, ?, ?)",
                [(key, intent.tag, cid) for key, cid in rows],
            )

    def record(self, tag: str, batch_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE intents SET batch_id = ? WHERE tag = ?", (batch_id, tag))

    def forget(self, tag: str) -> None:
        """Drop an intent and its requests (never submitted, or its batch is gone)."""
        with self._lock:
            self._db.execute("DELETE FROM intents WHERE tag = ?", (tag,))

    def clean(self, max_age_s: float) -> int:
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM intents WHERE created_at < ?", (time.time() - max_age_s,)
            )
        return cur.rowcount

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
