"""The embedded backend: one SQLite file, safe for several processes on one machine.

WAL lets readers run beside the writer, and every batch is one `BEGIN IMMEDIATE` transaction,
so processes sharing the file take turns per batch and each sees the others' holds. Each
limit row keeps its current `used` sum, so a reserve costs a few indexed lookups however many
holds are live; expired holds are dropped (and subtracted) at the start of each transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shoal.quota.clock import Clock, SystemClock
from shoal.quota.errors import ItemError, QuotaBackendError, QuotaInvalidError
from shoal.quota.limits import LeasePolicy, Limit, LimitKind
from shoal.quota.types import (
    CompleteRequest,
    CompleteResult,
    ReserveRequest,
    ReserveResult,
    Usage,
    fingerprint,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS limits (
    key TEXT PRIMARY KEY, kind TEXT NOT NULL, capacity INTEGER NOT NULL,
    window_ms INTEGER NOT NULL, used INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS holds (
    lease_id TEXT NOT NULL, key TEXT NOT NULL, part TEXT NOT NULL,
    amount INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL,
    PRIMARY KEY (lease_id, key, part));
CREATE INDEX IF NOT EXISTS holds_by_expiry ON holds (expires_at_ms);
CREATE INDEX IF NOT EXISTS holds_by_key ON holds (key, expires_at_ms);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, allowed INTEGER NOT NULL,
    retry_after_ms INTEGER NOT NULL, reserved_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
    requirements TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases (expires_at_ms);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_RESERVED, _OVERAGE = "r", "o"  # a lease's hold per key, and the debt its Complete added


@dataclass(slots=True)
class _Row:
    """A limit as read in this transaction; `used` is written back once at its end."""

    kind: LimitKind
    capacity: int
    window_ms: int
    used: int
    dirty: bool = False

    def add(self, amount: int) -> None:
        self.used += amount
        self.dirty = True


class _Txn:
    """One transaction's view: the time and the limits it touched."""

    def __init__(self, db: sqlite3.Connection, now: int) -> None:
        self.db = db
        self.now = now
        self.rows: dict[str, _Row | None] = {}

    def limit(self, key: str) -> _Row | None:
        if key not in self.rows:
            found = self.db.execute(
                "SELECT kind, capacity, window_ms, used FROM limits WHERE key = ?", (key,)
            ).fetchone()
            self.rows[key] = _Row(LimitKind(found[0]), *found[1:]) if found else None
        return self.rows[key]

    def write_back(self) -> None:
        self.db.executemany(
            "UPDATE limits SET used = ? WHERE key = ?",
            [(row.used, key) for key, row in self.rows.items() if row is not None and row.dirty],
        )


class SQLiteBackend:
    name = "sqlite"

    def __init__(
        self,
        path: str | Path,
        *,
        policy: LeasePolicy | None = None,
        clock: Clock | None = None,
        busy_timeout_s: float = 30.0,
    ) -> None:
        self.policy = policy or LeasePolicy()
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()  # one connection, shared by the server's worker threads
        try:
            self._db = sqlite3.connect(
                str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across process crashes
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise QuotaBackendError(f"cannot open the quota backend sqlite:///{path}: {e}") from e

    # -- transactions -------------------------------------------------------------------

    @contextmanager
    def _txn(self) -> Iterator[_Txn]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise QuotaBackendError(f"sqlite: {e}") from e
            try:
                txn = _Txn(self._db, self._now())
                self._purge(txn.now)
                yield txn
                txn.write_back()
                self._db.execute("COMMIT")
            except BaseException as e:
                self._db.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise QuotaBackendError(f"sqlite: {e}") from e
                raise

    def _now(self) -> int:
        """The clock, never behind the latest time any process stored in this file."""
        row = self._db.execute("SELECT value FROM meta WHERE name = 'clock'").fetchone()
        now = max(self._clock.now_ms(), row[0] if row else 0)
        self._db.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('clock', ?)", (now,))
        return now

    def _purge(self, now: int) -> None:
        expired = self._db.execute(
            "SELECT key, SUM(amount) FROM holds WHERE expires_at_ms <= ? GROUP BY key", (now,)
        ).fetchall()
        if expired:
            self._db.executemany(
                "UPDATE limits SET used = used - ? WHERE key = ?", [(s, k) for k, s in expired]
            )
            self._db.execute("DELETE FROM holds WHERE expires_at_ms <= ?", (now,))
        self._db.execute("DELETE FROM leases WHERE expires_at_ms <= ?", (now,))

    # -- reserve ------------------------------------------------------------------------

    def reserve_many(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        with self._txn() as txn:
            return [self._reserve(txn, item) for item in items]

    def _reserve(self, txn: _Txn, item: ReserveRequest) -> ReserveResult:
        fp = fingerprint(item)
        prev = txn.db.execute(
            "SELECT fingerprint, allowed, retry_after_ms, reserved_at_ms FROM leases"
            " WHERE lease_id = ?",
            (item.lease_id,),
        ).fetchone()
        if prev is not None:
            if prev[0] != fp:
                return ReserveResult(False, error=ItemError.LEASE_CONFLICT)
            return ReserveResult(bool(prev[1]), prev[2], prev[3])
        rows: list[_Row] = []
        for req in item.requirements:
            row = txn.limit(req.key)
            if row is None:
                return ReserveResult(False, error=f"{ItemError.UNKNOWN_LIMIT_KEY}:{req.key}")
            if req.amount > row.capacity:
                return ReserveResult(False, error=f"{ItemError.EXCEEDS_CAPACITY}:{req.key}")
            rows.append(row)
        waits = [
            self._wait_ms(txn, req.key, row, req.amount)
            for req, row in zip(item.requirements, rows, strict=True)
            if row.used + req.amount > row.capacity
        ]
        expires = txn.now + self.policy.ttl_ms
        if waits:
            self._record(txn, item, fp, ReserveResult(False, max(waits)), expires)
            return ReserveResult(False, max(waits))
        for req, row in zip(item.requirements, rows, strict=True):
            hold_expires = txn.now + row.window_ms
            txn.db.execute(
                "INSERT INTO holds VALUES (?, ?, ?, ?, ?)",
                (item.lease_id, req.key, _RESERVED, req.amount, hold_expires),
            )
            row.add(req.amount)
            expires = max(expires, hold_expires)
        result = ReserveResult(True, 0, txn.now)
        self._record(txn, item, fp, result, expires)
        return result

    def _record(
        self, txn: _Txn, item: ReserveRequest, fp: str, result: ReserveResult, expires: int
    ) -> None:
        reqs = json.dumps([[r.key, r.amount] for r in item.requirements])
        txn.db.execute(
            "INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
            (
                item.lease_id,
                fp,
                int(result.allowed),
                result.retry_after_ms,
                result.reserved_at_unix_ms,
                expires,
                reqs,
            ),
        )

    def _wait_ms(self, txn: _Txn, key: str, row: _Row, amount: int) -> int:
        """How long until enough of `key`'s holds expire for `amount` to fit.

        Every live hold expires within one window, so the window bounds the walk's answer.
        A concurrency hold may be released by a Complete at any moment, so there the answer
        is capped at the policy's polling hint."""
        need, freed, wait = row.used + amount - row.capacity, 0, row.window_ms
        holds = txn.db.execute(
            "SELECT amount, expires_at_ms FROM holds WHERE key = ? ORDER BY expires_at_ms",
            (key,),
        )
        for held, expires_at in holds:
            freed += held
            if freed >= need:
                wait = expires_at - txn.now
                break
        if row.kind is LimitKind.CONCURRENCY:
            wait = min(wait, self.policy.concurrency_retry_ms)
        return max(1, wait)

    # -- complete -----------------------------------------------------------------------

    def complete_many(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        with self._txn() as txn:
            return [self._complete(txn, item) for item in items]

    def _complete(self, txn: _Txn, item: CompleteRequest) -> CompleteResult:
        lease = txn.db.execute(
            "SELECT allowed, completed, requirements FROM leases WHERE lease_id = ?",
            (item.lease_id,),
        ).fetchone()
        if lease is None:
            return CompleteResult(False, ItemError.LEASE_NOT_FOUND)
        if not lease[0]:
            return CompleteResult(False, ItemError.LEASE_DENIED)
        if lease[1]:
            return CompleteResult(False, ItemError.ALREADY_COMPLETED)
        actual: dict[str, int] = {}
        for a in item.actuals:
            row = txn.limit(a.key)
            if row is None:
                return CompleteResult(False, f"{ItemError.UNKNOWN_LIMIT_KEY}:{a.key}")
            if row.kind is not LimitKind.RATE:
                return CompleteResult(False, ItemError.INVALID_REQUEST)
            actual[a.key] = a.actual_amount
        reserved: dict[str, int] = dict(json.loads(lease[2]))
        for key in sorted(reserved.keys() | actual.keys()):
            row = txn.limit(key)
            if row is None:  # cannot happen: limits are never deleted
                continue
            amount = reserved.get(key, 0)
            spent = actual.get(key, amount)
            if row.kind is LimitKind.CONCURRENCY:
                self._refund(txn, item.lease_id, key, row, amount)
            elif spent < amount:
                self._refund(txn, item.lease_id, key, row, amount - spent)
            elif spent > amount:  # debt: charged from now, for one window
                txn.db.execute(
                    "INSERT INTO holds VALUES (?, ?, ?, ?, ?)",
                    (item.lease_id, key, _OVERAGE, spent - amount, txn.now + row.window_ms),
                )
                row.add(spent - amount)
        txn.db.execute("UPDATE leases SET completed = 1 WHERE lease_id = ?", (item.lease_id,))
        return CompleteResult(True)

    def _refund(self, txn: _Txn, lease_id: str, key: str, row: _Row, amount: int) -> None:
        """Give back `amount` of the lease's hold on `key`, if the hold has not expired."""
        ident = (lease_id, key, _RESERVED)
        held = txn.db.execute(
            "SELECT amount FROM holds WHERE lease_id = ? AND key = ? AND part = ?", ident
        ).fetchone()
        if held is None:
            return
        if held[0] > amount:
            txn.db.execute(
                "UPDATE holds SET amount = ? WHERE lease_id = ? AND key = ? AND part = ?",
                (held[0] - amount, *ident),
            )
        else:
            txn.db.execute("DELETE FROM holds WHERE lease_id = ? AND key = ? AND part = ?", ident)
        row.add(-min(amount, held[0]))

    # -- limits and usage ---------------------------------------------------------------

    def put_limits(self, limits: Sequence[Limit]) -> None:
        with self._txn() as txn:
            for lim in limits:
                row = txn.limit(lim.key)
                if row is not None and row.kind is not lim.kind:
                    raise QuotaInvalidError(f"limit {lim.key} is a {row.kind} limit already")
            txn.db.executemany(
                "INSERT INTO limits (key, kind, capacity, window_ms) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET"
                " capacity = excluded.capacity, window_ms = excluded.window_ms",
                [(lim.key, str(lim.kind), lim.capacity, lim.window_ms) for lim in limits],
            )

    def usage(self) -> list[Usage]:
        with self._txn() as txn:
            rows = txn.db.execute(
                "SELECT key, kind, capacity, window_ms, used FROM limits ORDER BY key"
            ).fetchall()
        return [Usage(k, kind, cap, win / 1000, used) for k, kind, cap, win, used in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
