"""The shared store: PostgreSQL through psycopg 3 (`pip install 'shoal[postgres]'`), for
several servers on several machines. Nothing else in shoal imports psycopg.

File bytes live in the database too, as 1 MiB `bytea` chunks in `blob_chunks` (one
transaction per file), so every replica reads every file with no shared disk, and a file is
backed up, replicated and deleted with the rest of the state. Row locks stand in for SQLite's
single writer: `FOR UPDATE` on a batch row for each status change, `FOR SHARE` while a result
is written (so no result lands after its batch left `in_progress`), and `SKIP LOCKED` so
replicas claiming lines at the same moment look at different ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shoal.server.store.base import Store, StoreError
from shoal.server.store.sql import Tx
from shoal.urls import redact

CHUNK = 1 << 20
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT UNIQUE NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    expires_at BIGINT,
    blob TEXT,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE TABLE IF NOT EXISTS blob_chunks (
    name TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (name, seq)
);
CREATE TABLE IF NOT EXISTS batches (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    obj TEXT NOT NULL,
    worker TEXT,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    body TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
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
CREATE TABLE IF NOT EXISTS replicas (id TEXT PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT UNIQUE NOT NULL,
    chain TEXT NOT NULL,
    created_at BIGINT NOT NULL,
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
-- stores from before tenants: their rows belong to `default`
ALTER TABLE files ADD COLUMN IF NOT EXISTS tenant TEXT NOT NULL DEFAULT 'default';
ALTER TABLE batches ADD COLUMN IF NOT EXISTS tenant TEXT NOT NULL DEFAULT 'default';
ALTER TABLE responses ADD COLUMN IF NOT EXISTS tenant TEXT NOT NULL DEFAULT 'default';
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, seq);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, seq);
"""
_SCHEMA_LOCK = 0x5_40A1  # an advisory lock: replicas starting together create tables in turn


def _slices(content: bytes | Iterable[bytes]) -> Iterator[bytes]:
    """`content` as pieces of at most `CHUNK` bytes; at least one (a file may be empty)."""
    pieces = [content] if isinstance(content, bytes | bytearray | memoryview) else content
    sent = False
    for piece in pieces:
        view = memoryview(piece)
        for start in range(0, len(view), CHUNK):
            sent = True
            yield bytes(view[start : start + CHUNK])
    if not sent:
        yield b""


class TableBlobs:
    """File bytes as numbered chunks in one table, each file written in one transaction."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def put(self, name: str, content: bytes | Iterable[bytes]) -> int:
        size = 0
        with self._pool.connection() as conn:
            for seq, piece in enumerate(_slices(content)):
                sql = "INSERT INTO blob_chunks (name, seq, data) VALUES (%s, %s, %s)"
                conn.execute(sql, (name, seq, piece))
                size += len(piece)
        return size

    def _chunk(self, name: str, seq: int) -> bytes | None:
        with self._pool.connection() as conn:
            sql = "SELECT data FROM blob_chunks WHERE name = %s AND seq = %s"
            row = conn.execute(sql, (name, seq)).fetchone()
        return None if row is None else bytes(row[0])

    def open(self, name: str) -> Iterator[bytes] | None:
        first = self._chunk(name, 0)
        if first is None:
            return None

        def chunks() -> Iterator[bytes]:  # one short query per chunk: no long transaction
            seq, chunk = 0, first
            while True:
                yield chunk
                seq += 1
                following = self._chunk(name, seq)
                if following is None:
                    return
                chunk = following

        return chunks()

    def delete(self, name: str) -> None:
        with self._pool.connection() as conn:
            conn.execute("DELETE FROM blob_chunks WHERE name = %s", (name,))


class PostgresStore(Store):
    name = "postgresql"
    NOW = "extract(epoch from clock_timestamp())::float8"
    FOR_UPDATE = " FOR UPDATE"
    FOR_SHARE = " FOR SHARE"
    CLAIM_LOCK = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, *, max_connections: int = 8, connect_timeout_s: int = 10):
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as e:
            raise StoreError(
                f"a postgresql:// store needs psycopg: pip install 'shoal[postgres]' ({e})"
            ) from e
        self.url = redact(url)
        self._errors: tuple[type[Exception], ...] = (psycopg.OperationalError,)
        kwargs: dict[str, Any] = {"connect_timeout": connect_timeout_s}
        try:  # one direct connection first: its error says why (refused, auth, no database)
            with psycopg.connect(url, connect_timeout=connect_timeout_s) as conn:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                conn.execute(SCHEMA)
        except psycopg.Error as e:  # libpq's message has a hint on a second line: one line
            raise StoreError(f"cannot open the store {self.url}: {' '.join(str(e).split())}") from e
        self.pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            kwargs=kwargs,
            timeout=connect_timeout_s,  # how long a call waits for a connection
            # A connection the database dropped (a restart, a failover) is replaced before
            # use rather than failing a call: one extra round trip per call.
            check=ConnectionPool.check_connection,
            open=False,
        )
        try:
            self.pool.open(wait=True, timeout=connect_timeout_s)
        except psycopg.Error as e:  # it answered a moment ago: gone again
            self.pool.close()
            raise StoreError(f"cannot open the store {self.url}: {e}") from e
        self.blobs = TableBlobs(self.pool)

    def close(self) -> None:
        self.pool.close()

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Tx]:
        try:
            with self.pool.connection() as conn:  # commits at the end, rolls back on error
                yield Tx(conn, "%s")
        except self._errors as e:
            raise StoreError(f"the store {self.url} failed: {' '.join(str(e).split())}") from e

    def _json(self, field: str) -> str:
        return f"(obj::json ->> '{field}')"

    def _insert_lines(self, tx: Tx, batch_id: str, keys: Sequence[tuple[str, int]]) -> None:
        """One statement for the whole file (50,000 lines: a fraction of a second)."""
        tx.q(
            "INSERT INTO lines (batch_id, custom_id, line) "
            "SELECT ?, * FROM unnest(?::text[], ?::int[]) ON CONFLICT DO NOTHING",
            (batch_id, [cid for cid, _ in keys], [no for _, no in keys]),
        )
