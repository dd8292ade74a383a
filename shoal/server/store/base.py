"""The Files + Batch API state, written once in SQL that SQLite and PostgreSQL both run.

`Store` holds files (metadata here, bytes in `blobs`), batches (the API object as JSON text,
its status in a column of its own), a batch's lines (which replica runs each) and their
results. Subclasses give the connection and transactions, the schema, the few SQL fragments
that differ (the clock, a JSON field, row locks) and where file bytes live.

Several servers may share one store; these rules make that safe:
- every status change is a compare-and-set on the batch row (`update_batch(expect=...)`);
- a result is accepted only while its batch is `in_progress`, checked under a share lock on
  the batch row, and keyed by `(batch_id, custom_id)`: written once, never after the batch
  left `in_progress`, so a finalizer reads a frozen table;
- a line is run by the replica that claimed it; a claim lapses when its replica's heartbeat
  (`replicas.expires_at`) does, so another replica re-takes it;
- one replica at a time finalizes (`batches.worker`), and the output files, counts and the
  terminal status land in one transaction (`finish_batch`), or not at all.
"""

from __future__ import annotations

import json
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.errors import ShoalError
from shoal.server.ids import new_id, storable
from shoal.server.store.status import CLOSING, BatchStatus


class StoreError(ShoalError):
    """The store cannot be opened or reached (a bad URL, a missing folder, a database that
    does not answer)."""


class Blobs(Protocol):
    """Where file bytes live. A blob is written whole under a fresh name before any row
    points at it, so a reader never sees a partial one."""

    def put(self, name: str, content: bytes | Iterable[bytes]) -> int: ...

    def open(self, name: str) -> Iterator[bytes] | None: ...

    def delete(self, name: str) -> None: ...


@dataclass(slots=True)
class OutputFile:
    """A file a finalizer creates together with the batch's terminal status."""

    file_id: str
    filename: str
    content: bytes


class Tx:
    """One transaction on a DB-API connection; SQL is written with `?` placeholders."""

    def __init__(self, conn: Any, placeholder: str = "?") -> None:
        self._conn = conn
        self._ph = placeholder

    def _sql(self, sql: str) -> str:
        return sql if self._ph == "?" else sql.replace("?", self._ph)

    def q(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._conn.execute(self._sql(sql), tuple(args))

    def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._conn.cursor().executemany(self._sql(sql), [tuple(r) for r in rows])


_FILE_COLS = "id, bytes, created_at, filename, purpose, expires_at"


def _file_obj(row: Sequence[Any]) -> dict[str, Any]:
    return {
        "id": row[0],
        "object": "file",
        "bytes": int(row[1]),
        "created_at": int(row[2]),
        "filename": row[3],
        "purpose": row[4],
        "status": "processed",
        "expires_at": row[5],
        "status_details": None,
    }


def _marks(values: Sequence[Any]) -> str:
    return ",".join("?" * len(values))


class Store(ABC):
    name: str  # "sqlite" or "postgresql"
    url: str  # where it is, safe to log (no password)
    blobs: Blobs
    NOW: str  # SQL: seconds since the epoch on the database's clock
    FOR_UPDATE = ""  # row locks; SQLite needs none (one writer at a time)
    FOR_SHARE = ""
    CLAIM_LOCK = ""

    @abstractmethod
    def _tx(self, write: bool = True) -> AbstractContextManager[Tx]:
        """A transaction, committed when the block ends, rolled back if it raises."""

    @abstractmethod
    def _json(self, field: str) -> str:
        """SQL reading a top-level string field of a batch's `obj`."""

    @abstractmethod
    def close(self) -> None: ...

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._tx(write=False) as tx:
            return list(tx.q(sql, args).fetchall())

    # -- files -----------------------------------------------------------------------------
    def create_file(
        self,
        filename: str,
        purpose: str,
        content: bytes | Iterable[bytes],
        *,
        file_id: str | None = None,
        expires_at: int | None = None,
    ) -> dict[str, Any]:
        """Store `content` (bytes, or chunks streamed through) whole, then record it."""
        file_id = file_id or new_id("file-")
        blob = f"{file_id}.{secrets.token_hex(4)}.jsonl"
        size = self.blobs.put(blob, content)
        try:
            with self._tx() as tx:
                self._insert_file(tx, file_id, size, filename, purpose, expires_at, blob)
        except BaseException:
            self.blobs.delete(blob)
            raise
        obj = self.get_file(file_id)
        assert obj is not None
        return obj

    def _insert_file(
        self,
        tx: Tx,
        file_id: str,
        size: int,
        filename: str,
        purpose: str,
        expires_at: int | None,
        blob: str,
    ) -> None:
        tx.q(
            f"INSERT INTO files ({_FILE_COLS}, blob) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (file_id, size, int(time.time()), filename, purpose, expires_at, blob),
        )

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        if not storable(file_id):
            return None
        rows = self._rows(f"SELECT {_FILE_COLS} FROM files WHERE id = ?", (file_id,))
        return _file_obj(rows[0]) if rows else None

    def read_file(self, file_id: str) -> Iterator[bytes] | None:
        """The file's bytes in chunks, or None when there is no such file."""
        if not storable(file_id):
            return None
        rows = self._rows("SELECT blob FROM files WHERE id = ?", (file_id,))
        return self.blobs.open(rows[0][0] or f"{file_id}.jsonl") if rows else None

    def list_files(
        self, *, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        desc = order == "desc"
        sql, args = f"SELECT {_FILE_COLS} FROM files WHERE 1=1", list[Any]()
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:
            if not storable(after):
                return [], False
            sql += f" AND seq {'<' if desc else '>'} (SELECT seq FROM files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"
        args.append(limit + 1)
        rows = self._rows(sql, args)
        return [_file_obj(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        if not storable(file_id):
            return False
        with self._tx() as tx:
            row = tx.q("SELECT blob FROM files WHERE id = ?", (file_id,)).fetchone()
            tx.q("DELETE FROM files WHERE id = ?", (file_id,))
        if row is not None:  # the bytes go once no row points at them
            self.blobs.delete(row[0] or f"{file_id}.jsonl")
        return row is not None

    # -- batches ---------------------------------------------------------------------------
    def create_batch(self, obj: dict[str, Any]) -> None:
        with self._tx() as tx:
            tx.q(
                "INSERT INTO batches (id, status, obj) VALUES (?, ?, ?)",
                (obj["id"], str(obj["status"]), json.dumps(obj)),
            )

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        if not storable(batch_id):
            return None
        rows = self._rows("SELECT obj FROM batches WHERE id = ?", (batch_id,))
        return dict(json.loads(rows[0][0])) if rows else None

    def update_batch(
        self,
        batch_id: str,
        *,
        expect: Iterable[str] | None = None,
        worker: str | None = None,
        when_lines_done: bool = False,
        **fields: Any,
    ) -> dict[str, Any] | None:
        """Merge `fields` into the batch object, only while its status is one of `expect`
        (when given) and, with `when_lines_done`, every line has its result; `worker` makes
        that replica the batch's finalizer (every update sets it: None clears it). The new
        object, or None when nothing changed."""
        try:
            with self._tx() as tx:
                obj = self._update(tx, batch_id, fields, expect=expect, worker=worker)
                # Checked after the row lock: no result can land between check and update.
                if obj is not None and when_lines_done and self._left(tx, batch_id):
                    raise _Unchanged
                return obj
        except _Unchanged:
            return None

    def _update(
        self,
        tx: Tx,
        batch_id: str,
        fields: dict[str, Any],
        *,
        expect: Iterable[str] | None = None,
        worker: str | None = None,
        held_by: str | None = None,
    ) -> dict[str, Any] | None:
        row = tx.q(
            f"SELECT status, obj, worker FROM batches WHERE id = ?{self.FOR_UPDATE}", (batch_id,)
        ).fetchone()
        if row is None or (expect is not None and row[0] not in set(map(str, expect))):
            return None
        if held_by is not None and row[2] != held_by:
            return None
        obj = dict(json.loads(row[1]))
        obj.update(fields)
        tx.q(
            "UPDATE batches SET status = ?, obj = ?, worker = ? WHERE id = ?",
            (str(obj["status"]), json.dumps(obj), worker, batch_id),
        )
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
        if not all(storable(c) for c in (after, before) if c):
            return [], False
        where, args = ["1=1"], list[Any]()
        if endpoints:
            where.append(f"{self._json('endpoint')} IN ({_marks(endpoints)})")
            args += endpoints
        if after:
            where.append("seq < (SELECT seq FROM batches WHERE id = ?)")
            args.append(after)
        if before:
            where.append("seq > (SELECT seq FROM batches WHERE id = ?)")
            args.append(before)
        order = "ASC" if before and not after else "DESC"
        sql = f"SELECT obj FROM batches WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?"
        rows = self._rows(sql, (*args, limit + 1))
        page = [json.loads(r[0]) for r in rows[:limit]]
        return (page[::-1] if order == "ASC" else page), len(rows) > limit

    def delete_batch(self, batch_id: str) -> None:
        """Forget a finished batch, its lines and results (its files are the caller's)."""
        with self._tx() as tx:
            for table, key in (("results", "batch_id"), ("lines", "batch_id"), ("batches", "id")):
                tx.q(f"DELETE FROM {table} WHERE {key} = ?", (batch_id,))

    def batch_ids(self, statuses: Iterable[str]) -> list[str]:
        """Batches in one of `statuses`, oldest first."""
        wanted = tuple(map(str, statuses))
        sql = f"SELECT id FROM batches WHERE status IN ({_marks(wanted)}) ORDER BY seq"
        return [r[0] for r in self._rows(sql, wanted)]

    def batches_using_file(self, file_id: str, statuses: Iterable[str]) -> list[str]:
        wanted = tuple(map(str, statuses))
        sql = (
            f"SELECT id FROM batches WHERE status IN ({_marks(wanted)}) "
            f"AND {self._json('input_file_id')} = ?"
        )
        return [r[0] for r in self._rows(sql, (*wanted, file_id))]

    # -- replicas and their claims on lines --------------------------------------------------
    def heartbeat(self, replica: str, lease_s: float) -> None:
        """`replica` is alive for `lease_s` more seconds: its claims hold until then."""
        with self._tx() as tx:
            tx.q(
                f"INSERT INTO replicas (id, expires_at) VALUES (?, {self.NOW} + ?) "
                "ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at",
                (replica, float(lease_s)),
            )

    def release_lines(self, replica: str, batch_id: str | None = None) -> None:
        """Hand back `replica`'s unfinished lines (of one batch, or all of them)."""
        sql, args = "UPDATE lines SET owner = NULL WHERE owner = ? AND done = 0", [replica]
        if batch_id is not None:
            sql += " AND batch_id = ?"
            args.append(batch_id)
        with self._tx() as tx:
            tx.q(sql, args)

    def leave(self, replica: str) -> None:
        """A clean exit: others may take its lines and finalizations at once."""
        self.release_lines(replica)
        with self._tx() as tx:
            tx.q("DELETE FROM replicas WHERE id = ?", (replica,))

    def add_lines(self, batch_id: str, keys: Sequence[tuple[str, int]]) -> None:
        """Record a running batch's lines `(custom_id, line number)` once (every replica
        calls this; lines that already have a result are marked done)."""
        with self._tx() as tx:
            have = tx.q("SELECT COUNT(*) FROM lines WHERE batch_id = ?", (batch_id,)).fetchone()
            if int(have[0]) >= len(keys):
                return
            self._insert_lines(tx, batch_id, keys)
            tx.q(
                "UPDATE lines SET done = 1 WHERE batch_id = ? AND done = 0 AND custom_id IN "
                "(SELECT custom_id FROM results WHERE batch_id = ?)",
                (batch_id, batch_id),
            )

    def _insert_lines(self, tx: Tx, batch_id: str, keys: Sequence[tuple[str, int]]) -> None:
        tx.many(
            "INSERT INTO lines (batch_id, custom_id, line) VALUES (?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            [(batch_id, cid, no) for cid, no in keys],
        )

    def claim_lines(self, batch_id: str, replica: str, limit: int) -> list[str]:
        """Up to `limit` unfinished lines nobody alive holds, now `replica`'s, in file order.

        The update re-checks each row against the rule: under concurrent claims PostgreSQL's
        search may return a row that another claimer took since it looked, and only the
        update sees the row's latest owner (the rule reads `replicas` in a subquery, not a
        join, for that re-check to hold)."""
        free = (
            "done = 0 AND (owner IS NULL OR (owner <> ? AND owner NOT IN "
            f"(SELECT id FROM replicas WHERE expires_at >= {self.NOW})))"
        )
        with self._tx() as tx:
            rows = tx.q(
                f"SELECT custom_id FROM lines WHERE batch_id = ? AND {free} "
                f"ORDER BY line LIMIT ?{self.CLAIM_LOCK}",
                (batch_id, replica, limit),
            ).fetchall()
            ids = [r[0] for r in rows]
            if not ids:
                return []
            won = tx.q(
                f"UPDATE lines SET owner = ? WHERE batch_id = ? AND {free} "
                f"AND custom_id IN ({_marks(ids)}) RETURNING custom_id",
                (replica, batch_id, replica, *ids),
            ).fetchall()
        taken = {r[0] for r in won}
        return [i for i in ids if i in taken]

    def lines_left(self, batch_id: str) -> int:
        sql = "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND done = 0"
        return int(self._rows(sql, (batch_id,))[0][0])

    def _left(self, tx: Tx, batch_id: str) -> bool:
        sql = "SELECT 1 FROM lines WHERE batch_id = ? AND done = 0 LIMIT 1"
        return tx.q(sql, (batch_id,)).fetchone() is not None

    # -- results and finalization ------------------------------------------------------------
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
        """Record one finished request; False if it was already recorded or its batch is no
        longer in progress (cancelled, expired, finalizing: the result is not wanted)."""
        with self._tx() as tx:
            row = tx.q(
                f"SELECT status FROM batches WHERE id = ?{self.FOR_SHARE}", (batch_id,)
            ).fetchone()
            if row is None or row[0] != BatchStatus.IN_PROGRESS:
                return False
            cur = tx.q(
                "INSERT INTO results (batch_id, custom_id, line, ok, body, prompt_tokens, "
                "completion_tokens) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (batch_id, custom_id, line, int(ok), json.dumps(body), prompt_tokens,
                 completion_tokens),
            )  # fmt: skip
            tx.q(
                "UPDATE lines SET done = 1, owner = NULL WHERE batch_id = ? AND custom_id = ?",
                (batch_id, custom_id),
            )
            return bool(cur.rowcount > 0)

    def done_custom_ids(self, batch_id: str) -> set[str]:
        sql = "SELECT custom_id FROM results WHERE batch_id = ?"
        return {r[0] for r in self._rows(sql, (batch_id,))}

    def result_counts(self, batch_id: str) -> tuple[int, int, int, int]:
        """(completed, failed, prompt_tokens, completion_tokens)."""
        row = self._rows(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
            "FROM results WHERE batch_id = ?",
            (batch_id,),
        )[0]
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])

    def results(self, batch_id: str) -> Iterator[tuple[bool, str]]:
        sql = "SELECT ok, body FROM results WHERE batch_id = ? ORDER BY line"
        for r in self._rows(sql, (batch_id,)):
            yield bool(r[0]), r[1]

    def claim_finalizer(self, batch_id: str, replica: str) -> bool:
        """Make `replica` the finalizer of a closing batch, unless another live one is."""
        with self._tx() as tx:
            cur = tx.q(
                f"UPDATE batches SET worker = ? WHERE id = ? AND status IN ({_marks(CLOSING)}) "
                "AND (worker IS NULL OR worker = ? OR worker NOT IN "
                f"(SELECT id FROM replicas WHERE expires_at >= {self.NOW}))",
                (replica, batch_id, *map(str, CLOSING), replica),
            )
            return bool(cur.rowcount > 0)

    def finish_batch(
        self, batch_id: str, worker: str, files: Sequence[OutputFile], **fields: Any
    ) -> dict[str, Any] | None:
        """End a closing batch that `worker` finalizes: its files and `fields` (the terminal
        status among them) in one transaction. None when it was not `worker`'s to end."""
        blobs = [f"{f.file_id}.{secrets.token_hex(4)}.jsonl" for f in files]
        sizes = [self.blobs.put(b, f.content) for b, f in zip(blobs, files, strict=True)]
        obj = None
        try:
            with self._tx() as tx:
                obj = self._update(tx, batch_id, fields, expect=CLOSING, held_by=worker)
                if obj is not None:
                    for f, blob, size in zip(files, blobs, sizes, strict=True):
                        name, purpose = f.filename, "batch_output"
                        self._insert_file(tx, f.file_id, size, name, purpose, None, blob)
        finally:
            if obj is None:
                for blob in blobs:
                    self.blobs.delete(blob)
        return obj


class _Unchanged(Exception):
    """Raised inside a transaction to roll it back: a condition did not hold."""
