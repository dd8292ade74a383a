"""The Files + Batch API state, written once in SQL that SQLite and PostgreSQL both run
(stored Responses API objects too: `responses.py`).

Every file, batch and response has a `tenant`; the API's reads name the caller's (`tenant=`,
never left out), so another tenant's object is not found and lists hold only the caller's.
`tenant=None` is the server's own access (the runner, finalizers). Rows from before tenants
belong to `default`.

`Store` holds files (metadata here, bytes in `blobs`) and batches (the API object as JSON
text, its status in a column of its own); a batch's lines, their claims and results come from
`claims.LineTables`. Subclasses give the connection and transactions, the schema, the few SQL
fragments that differ (the clock, a JSON field, row locks) and where file bytes live.

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
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.errors import ShoalError
from shoal.server.ids import new_id, storable
from shoal.server.store.claims import LineTables
from shoal.server.store.responses import ResponseTables
from shoal.server.store.sql import DEFAULT_TENANT, Tx, marks, owned
from shoal.server.store.status import CLOSING


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


class Store(LineTables, ResponseTables):
    name: str  # "sqlite" or "postgresql"
    url: str  # where it is, safe to log (no password)
    blobs: Blobs

    @abstractmethod
    def _json(self, field: str) -> str:
        """SQL reading a top-level string field of a batch's `obj`."""

    @abstractmethod
    def close(self) -> None: ...

    # -- files -----------------------------------------------------------------------------
    def create_file(
        self, filename: str, purpose: str, content: bytes | Iterable[bytes], *, tenant: str
    ) -> dict[str, Any]:
        """Store `content` (bytes, or chunks streamed through) whole, then record it."""
        file_id = new_id("file-")
        blob = f"{file_id}.{secrets.token_hex(4)}.jsonl"
        size = self.blobs.put(blob, content)
        try:
            with self._tx() as tx:
                self._insert_file(tx, file_id, size, filename, purpose, blob, tenant)
        except BaseException:
            self.blobs.delete(blob)
            raise
        obj = self.get_file(file_id, tenant=tenant)
        assert obj is not None
        return obj

    def _insert_file(
        self,
        tx: Tx,
        file_id: str,
        size: int,
        filename: str,
        purpose: str,
        blob: str,
        tenant: str,
    ) -> None:
        tx.q(
            f"INSERT INTO files ({_FILE_COLS}, blob, tenant) VALUES (?, ?, ?, ?, ?, NULL, ?, ?)",
            (file_id, size, int(time.time()), filename, purpose, blob, tenant),
        )

    def get_file(self, file_id: str, *, tenant: str | None) -> dict[str, Any] | None:
        if not storable(file_id):
            return None
        cond, arg = owned(tenant)
        rows = self._rows(f"SELECT {_FILE_COLS} FROM files WHERE id = ?{cond}", (file_id, *arg))
        return _file_obj(rows[0]) if rows else None

    def read_file(self, file_id: str, *, tenant: str | None) -> Iterator[bytes] | None:
        """The file's bytes in chunks, or None when there is no such file."""
        if not storable(file_id):
            return None
        cond, arg = owned(tenant)
        rows = self._rows(f"SELECT blob FROM files WHERE id = ?{cond}", (file_id, *arg))
        return self.blobs.open(rows[0][0] or f"{file_id}.jsonl") if rows else None

    def list_files(
        self, *, tenant: str, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        desc = order == "desc"
        sql, args = f"SELECT {_FILE_COLS} FROM files WHERE tenant = ?", list[Any]([tenant])
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:  # a cursor names one of the caller's files, or nothing
            if not storable(after):
                return [], False
            seq = "(SELECT seq FROM files WHERE id = ? AND tenant = ?)"
            sql += f" AND seq {'<' if desc else '>'} {seq}"
            args += [after, tenant]
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"
        args.append(limit + 1)
        rows = self._rows(sql, args)
        return [_file_obj(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, *, tenant: str | None) -> bool:
        if not storable(file_id):
            return False
        cond, arg = owned(tenant)
        with self._tx() as tx:
            row = tx.q(f"SELECT blob FROM files WHERE id = ?{cond}", (file_id, *arg)).fetchone()
            tx.q(f"DELETE FROM files WHERE id = ?{cond}", (file_id, *arg))
        if row is not None:  # the bytes go once no row points at them
            self.blobs.delete(row[0] or f"{file_id}.jsonl")
        return row is not None

    # -- batches ---------------------------------------------------------------------------
    def create_batch(self, obj: dict[str, Any], *, tenant: str) -> None:
        with self._tx() as tx:
            tx.q(
                "INSERT INTO batches (id, status, obj, tenant) VALUES (?, ?, ?, ?)",
                (obj["id"], str(obj["status"]), json.dumps(obj), tenant),
            )

    def get_batch(self, batch_id: str, *, tenant: str | None) -> dict[str, Any] | None:
        if not storable(batch_id):
            return None
        cond, arg = owned(tenant)
        rows = self._rows(f"SELECT obj FROM batches WHERE id = ?{cond}", (batch_id, *arg))
        return dict(json.loads(rows[0][0])) if rows else None

    def batch_tenant(self, batch_id: str) -> str:
        """Whose batch it is (its lines run as that tenant)."""
        rows = self._rows("SELECT tenant FROM batches WHERE id = ?", (batch_id,))
        return str(rows[0][0]) if rows else DEFAULT_TENANT

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
        tenant: str,
        after: str | None = None,
        before: str | None = None,
        limit: int,
        endpoints: tuple[str, ...] | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """The tenant's batches, newest first: those older than `after`, or the `limit` just
        newer than `before`; only batches of `endpoints` when given (OpenAI and Anthropic
        lists stay apart)."""
        if not all(storable(c) for c in (after, before) if c):
            return [], False
        where, args = ["tenant = ?"], list[Any]([tenant])
        if endpoints:
            where.append(f"{self._json('endpoint')} IN ({marks(endpoints)})")
            args += endpoints
        cursor = "(SELECT seq FROM batches WHERE id = ? AND tenant = ?)"
        if after:
            where.append(f"seq < {cursor}")
            args += [after, tenant]
        if before:
            where.append(f"seq > {cursor}")
            args += [before, tenant]
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
        sql = f"SELECT id FROM batches WHERE status IN ({marks(wanted)}) ORDER BY seq"
        return [r[0] for r in self._rows(sql, wanted)]

    def batches_using_file(self, file_id: str, statuses: Iterable[str]) -> list[str]:
        wanted = tuple(map(str, statuses))
        sql = (
            f"SELECT id FROM batches WHERE status IN ({marks(wanted)}) "
            f"AND {self._json('input_file_id')} = ?"
        )
        return [r[0] for r in self._rows(sql, (*wanted, file_id))]

    def claim_finalizer(self, batch_id: str, replica: str) -> bool:
        """Make `replica` the finalizer of a closing batch, unless another live one is."""
        with self._tx() as tx:
            cur = tx.q(
                f"UPDATE batches SET worker = ? WHERE id = ? AND status IN ({marks(CLOSING)}) "
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
                if obj is not None:  # the batch's tenant owns its output
                    row = tx.q("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
                    for f, blob, size in zip(files, blobs, sizes, strict=True):
                        self._insert_file(
                            tx, f.file_id, size, f.filename, "batch_output", blob, row[0]
                        )
        finally:
            if obj is None:
                for blob in blobs:
                    self.blobs.delete(blob)
        return obj


class _Unchanged(Exception):
    """Raised inside a transaction to roll it back: a condition did not hold."""
