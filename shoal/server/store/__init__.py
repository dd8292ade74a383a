"""Durable Files + Batch API state behind one interface (`Store`), on SQLite (the default,
one machine) or PostgreSQL (shared by replicas on many machines); `open_store` picks by URL."""

from __future__ import annotations

from pathlib import Path

from shoal.server.store.base import OutputFile, Store, StoreError
from shoal.server.store.status import ACTIVE, CLOSING, TERMINAL, BatchStatus

__all__ = [
    "ACTIVE",
    "CLOSING",
    "TERMINAL",
    "BatchStatus",
    "OutputFile",
    "Store",
    "StoreError",
    "open_store",
]


def open_store(url: str | Path) -> Store:
    """A path or `sqlite:///relative.db` / `sqlite:////absolute.db` opens SQLite (file
    bytes in `files/` beside it); `postgresql://user:pass@host:port/db` opens PostgreSQL
    (needs `shoal[postgres]`). Raises `StoreError` when the store cannot be opened."""
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        from shoal.server.store.postgres import PostgresStore

        return PostgresStore(text)
    if text.startswith("sqlite:///"):
        text = text.removeprefix("sqlite:///")
    elif "://" in text:
        raise StoreError(
            f"unknown store URL {text!r}: give a path, sqlite:///path.db or postgresql://..."
        )
    from shoal.server.store.sqlite import SQLiteStore

    return SQLiteStore(Path(text))
