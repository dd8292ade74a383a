"""Crash-safe file writes, shared by the KV disk tier and the server's store.

A file is written under a temporary name, fsynced, renamed over its final name, and the folder
is fsynced so the rename itself survives a power cut: a reader sees the old file or the new one,
never a torn one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to a new file under a name no other writer uses and fsync it; no rename,
    no folder fsync: the caller renames what names it (a manifest) and fsyncs the folder once
    for all. A crash mid-write leaves a partial file nothing names."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes | Iterable[bytes]) -> int:
    """Write `data` (bytes, or chunks of it) to `path` all or nothing; returns its size."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size
