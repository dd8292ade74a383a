"""What both stores' SQL stands on: one transaction (`Tx`, SQL written with `?`
placeholders) and the hooks each database fills in (`Tables`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

DEFAULT_TENANT = "default"  # the owner of every row written before tenants (`--keys`)


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


def marks(values: Sequence[Any]) -> str:
    """`?,?,?`: one placeholder per value."""
    return ",".join("?" * len(values))


def owned(tenant: str | None) -> tuple[str, tuple[str, ...]]:
    """A WHERE clause's tenant condition and its argument: none for None (the server's own
    reads), else rows of `tenant` only."""
    return ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))


class Tables(ABC):
    NOW: str  # SQL: seconds since the epoch on the database's clock
    FOR_UPDATE = ""  # row locks; SQLite needs none (one writer at a time)
    FOR_SHARE = ""
    CLAIM_LOCK = ""

    @abstractmethod
    def _tx(self, write: bool = True) -> AbstractContextManager[Tx]:
        """A transaction, committed when the block ends, rolled back if it raises."""

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._tx(write=False) as tx:
            return list(tx.q(sql, args).fetchall())
