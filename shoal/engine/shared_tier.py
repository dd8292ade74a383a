"""The shared folder of the KV store: block files and session manifests in a folder several
engines share (the replicas of a cluster, or an engine and its successor after a kill -9), so
the next engine to serve a session reads its KV instead of recomputing it (no torch here).

The format is the disk tier's (`block_files.py`, `session_manifests.py`) at a shared root:
blocks are named by their chained hash, so a turn writes only the blocks the folder lacks (its
own new tokens' KV, not its history again), and a prefix shared by many sessions is stored
once.

- Write-behind. When a session's turn ends, the step thread copies the blocks this engine does
  not know to be in the folder (`publish`, before the answer leaves the engine) and a writer
  thread writes them (each fsynced, under a fresh name, renamed), then the manifest (staged,
  renamed over the old one), then fsyncs the folders, so a reader on any machine sees the old
  turn or the new one. A newer turn of a session replaces its queued older one (keeping the
  older one's unwritten blocks and its age). When the queued copies reach `max_pending_bytes`,
  `publish` waits: the engine slows to the storage's pace. `stats` keeps each write's lag.
- Many writers. A manifest is never replaced by an older turn of the same conversation (one
  whose tokens are a prefix of the stored ones). A reader never deletes (a file may be another
  engine's write in flight); block files no manifest names, and leftovers of dead writers, are
  swept once they are an hour old. A turn whose blocks another writer removed meanwhile is
  dropped with a warning, and the session's next turn is written whole.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shoal.durable import fsync_dir, write_synced
from shoal.engine.block_files import BlockFiles, KVLayout
from shoal.engine.hashing import Salt, session_hashes
from shoal.engine.host_tier import Payload, nbytes
from shoal.engine.session_manifests import (
    SessionManifest,
    manifest_name,
    read_manifest,
)
from shoal.errors import CacheCorruptionError

MiB = 1 << 20
SWEEP_AGE_S = 3600.0  # a leftover this old belongs to no live writer
KNOWN_BLOCKS = 1_000_000  # hashes this engine remembers the folder holds (16 B each)


class BlockReader(Protocol):
    def read_blocks(self, block_ids: list[int]) -> list[Payload]: ...

    @property
    def block_nbytes(self) -> int: ...


@dataclass(slots=True)
class _Turn:
    session_id: str
    token_ids: list[int]
    hashes: list[bytes]
    blocks: dict[bytes, Payload]  # the blocks to write
    nbytes: int
    last_used: float
    published: float  # monotonic: when the oldest turn this one replaced ended
    salt: Salt | None = None


@dataclass(slots=True)
class SharedStats:
    writes: int = 0
    reads: int = 0  # blocks read
    write_failures: int = 0
    superseded: int = 0  # writes skipped: the folder already held a later turn
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    max_lag: float = 0.0

    def lag_percentile(self, q: float) -> float:
        if not self.lags:
            return 0.0
        values = sorted(self.lags)
        return values[min(len(values) - 1, int(q * len(values)))]


def supersedes(stored: list[int], new: list[int]) -> bool:
    """Whether `stored` is a later turn of the conversation `new` belongs to."""
    return len(stored) > len(new) and stored[: len(new)] == new


class SharedTier:
    def __init__(
        self,
        layout: KVLayout,
        folder: str | Path,
        codec: BlockReader,
        root: bytes,
        max_pending_bytes: int = 256 * MiB,
    ) -> None:
        self.layout = layout
        self.codec = codec
        self.root = root
        self.max_pending_bytes = max_pending_bytes
        base = Path(folder).expanduser() / layout.key()
        self.files = BlockFiles(base / "blocks", codec.block_nbytes)
        self.sessions_dir = base / "sessions"
        self.sessions_dir.mkdir(parents=True, exist_ok=True)
        self.stats = SharedStats()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # in the folder, or queued
        self._pending: dict[str, _Turn] = {}  # insertion order: oldest first
        self._pending_bytes = 0
        self._writing = False
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._sweep()

    # -- writing (publish on the step thread; files on the writer thread) -------------------
    def publish(
        self,
        session_id: str,
        token_ids: list[int],
        blocks: dict[bytes, int],
        last_used: float,
        salt: Salt | None = None,
    ) -> None:
        """Queue a session's turn: `blocks` (hash -> pool block, in order, hashed with
        `salt`) hold `token_ids`; a copy is taken now of those the folder is not known to hold."""
        with self._cond:
            new = [h for h in blocks if h not in self._known]
        payloads = self.codec.read_blocks([blocks[h] for h in new]) if new else []
        turn = _Turn(
            session_id,
            list(token_ids),
            list(blocks),
            dict(zip(new, payloads, strict=True)),
            sum(map(nbytes, payloads)),
            last_used,
            time.monotonic(),
            salt,
        )
        with self._cond:
            while self._pending and self._pending_bytes + turn.nbytes > self.max_pending_bytes:
                self._cond.wait(1.0)
            old = self._pending.pop(session_id, None)
            if old is not None:  # its unwritten blocks still serve this turn's prefix
                turn.published = old.published
                self._pending_bytes -= old.nbytes
                keep = {h: p for h, p in old.blocks.items() if h in set(turn.hashes)}
                turn.blocks = {**keep, **turn.blocks}
                turn.nbytes = sum(map(nbytes, turn.blocks.values()))
            self._pending[session_id] = turn
            self._pending_bytes += turn.nbytes
            self._remember(turn.blocks)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_all, name="shoal-kv-shared", daemon=True
                )
                self._writer.start()

    def _remember(self, hashes: object) -> None:
        for h in hashes:  # type: ignore[attr-defined]
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_BLOCKS:
            self._known.popitem(last=False)

    @property
    def pending(self) -> int:
        return len(self._pending) + self._writing

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued turn is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout)

    def _write_all(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._writer = None
                    self._cond.notify_all()
                    return
                turn = self._pending.pop(next(iter(self._pending)))
                self._pending_bytes -= turn.nbytes
                self._writing = True
                self._cond.notify_all()  # room for a waiting publish
            try:
                written: bool | None = self._write(turn)
            except Exception as e:  # a full or unreachable share: the turn is not there
                written = None
                with self._cond:
                    for h in turn.hashes:  # the next turn is written whole
                        self._known.pop(h, None)
                self.stats.write_failures += 1
                warnings.warn(
                    f"session {turn.session_id!r}: not written to the shared folder: {e}",
                    stacklevel=1,
                )
            with self._cond:
                self._writing = False
                if written:
                    lag = time.monotonic() - turn.published
                    self.stats.writes += 1
                    self.stats.lags.append(lag)
                    self.stats.max_lag = max(self.stats.max_lag, lag)
                elif written is False:
                    self.stats.superseded += 1
                self._cond.notify_all()

    def _write(self, turn: _Turn) -> bool:
        """Write one turn; False if the folder already holds a later turn of it."""
        current = self._raw_manifest(turn.session_id)
        if current is not None and supersedes(current.token_ids, turn.token_ids):
            return False
        for h in turn.hashes:
            if h not in turn.blocks and not self.files.exists(h):
                raise FileNotFoundError("blocks it builds on were removed by another writer")
        folders = set()
        for h, payload in turn.blocks.items():
            if not self.files.exists(h):
                self.files.write(h, payload, durable=True)
                folders.add(self.files.path(h).parent)
        for folder in folders:  # the blocks' names, before the manifest that needs them
            fsync_dir(folder)
        m = SessionManifest.new(
            self.layout, turn.session_id, turn.token_ids, turn.last_used, turn.salt
        )
        staged = self.sessions_dir / f"{manifest_name(turn.session_id)}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            write_synced(staged, m.encode())
            os.replace(staged, self.sessions_dir / manifest_name(turn.session_id))
        except OSError:
            staged.unlink(missing_ok=True)
            raise
        fsync_dir(self.sessions_dir)
        return True

    # -- reading (the step thread, the prefetch thread) -----------------------------------------
    def _raw_manifest(self, session_id: str) -> SessionManifest | None:
        """The manifest as written (unchecked): enough to order writes."""
        try:
            return SessionManifest(
                **json.loads((self.sessions_dir / manifest_name(session_id)).read_text())
            )
        except (OSError, ValueError, TypeError):
            return None

    def peek(self, session_id: str) -> SessionManifest | None:
        """The session's copy in the folder, checked against this engine's layout; None if
        there is none or it cannot be used."""
        path = self.sessions_dir / manifest_name(session_id)
        try:
            return read_manifest(path, self.layout)
        except FileNotFoundError:
            return None
        except Exception as e:  # another model's, damaged, or replaced while being read
            warnings.warn(f"session {session_id!r}: shared copy not used: {e}", stacklevel=2)
            return None

    def has(self, h: bytes) -> bool:
        with self._cond:
            if h in self._known:
                return True
        return self.files.exists(h)

    def read(self, h: bytes) -> Payload | None:
        """Block `h`, checked whole; None (warned, the file left alone) if unusable."""
        with self._cond:
            for turn in self._pending.values():  # queued here, not written yet
                if h in turn.blocks:
                    return turn.blocks[h]
        if not self.files.exists(h):
            return None
        try:
            payload = self.files.read(h)
        except CacheCorruptionError as e:
            warnings.warn(
                f"KV block {h.hex()[:12]} in the shared folder not used: {e}", stacklevel=3
            )
            return None
        with self._cond:
            self._remember([h])
        self.stats.reads += 1
        return payload

    def delete(self, session_id: str) -> None:
        """Forget the session in the folder (its queued turn too); its blocks are swept once
        no manifest names them."""
        with self._cond:
            turn = self._pending.pop(session_id, None)
            if turn is not None:
                self._pending_bytes -= turn.nbytes
        (self.sessions_dir / manifest_name(session_id)).unlink(missing_ok=True)

    # -- start-up ------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Remove what no manifest names and no live writer can still own (an hour old)."""
        cutoff = time.time() - SWEEP_AGE_S
        named: set[bytes] = set()
        for path in self.sessions_dir.iterdir():
            try:
                if path.suffix == ".tmp":
                    if path.stat().st_mtime < cutoff:
                        path.unlink(missing_ok=True)
                    continue
                m = read_manifest(path, self.layout)
            except Exception:
                continue
            bs = self.layout.block_size
            named.update(session_hashes(self.root, m.token_ids, bs, salt=m.cache_salt()))
        for h, _, mtime in list(self.files.scan(sweep_tmp_older_than=SWEEP_AGE_S)):
            if h not in named and mtime < cutoff:
                self.files.delete(h)
