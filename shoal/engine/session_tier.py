"""The shared session tier: each finished turn's session KV, written behind to a folder that
several engines share (the replicas of a cluster, or an engine and its successor after a
kill -9), so that the next engine to serve a session restores it instead of recomputing.

No torch here: a `KVCodec` (the torch `SessionStore`) copies blocks and turns them into bytes.

- Write-behind, of what is new. When a turn ends, the step thread takes a CPU copy of the
  session's blocks that the tier does not hold yet (`publish`, before the answer leaves the
  engine) and a writer thread turns it into chunk files (`tier_files`: a session is a chain of
  chunks, so a turn writes its own blocks, not its whole history again). What the tier holds
  is known from the copy this engine last wrote or restored. A newer turn of a session
  replaces its older one in the queue, keeping the older one's place (and so its age). When
  the queued copies reach `max_pending_bytes`, `publish` waits: the engine slows to the
  storage's pace instead of the lag growing without bound. `stats` keeps each write's lag
  (turn end to durable file).
- Files. The new chunks go first, each under a fresh name and fsynced, then the manifest,
  staged under a fresh name and renamed over the old one, then one fsync of the folder, so a
  reader on any machine sees the old chain or the new one; chunks only the old manifest named
  are deleted after.
- Many writers. A copy is never replaced by an older turn of the same conversation (one whose
  tokens are a prefix of the stored ones). Nothing a reader cannot use is deleted by it (it may
  be another engine's write in flight); leftovers of writers that died are swept once they are
  an hour old. A write whose kept chunks another writer removed meanwhile (a conversation
  rewritten under the same id) is dropped with a warning, and the session's next turn is
  written whole.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

from shoal.durable import fsync_dir, write_synced
from shoal.engine.session_files import KVLayout, checksum, session_key, verify_tensor_file
from shoal.engine.tier_files import (
    TIER_VERSION,
    Chunk,
    Held,
    TierManifest,
    check_manifest,
    manifest_name,
    read_manifest,
    reusable,
)
from shoal.errors import CacheCorruptionError

MiB = 1 << 20
SWEEP_AGE_S = 3600.0  # a leftover this old belongs to no live writer
HELD_SESSIONS = 10_000  # sessions whose tier chunks this engine remembers (a few KiB each)


class KVCodec(Protocol):
    """How a backend copies session KV out of its pool and to and from file bytes."""

    def snapshot(self, block_ids: list[int]) -> Any:
        """A copy of the blocks' KV (the step thread: the pool may reuse them right after)."""
        ...

    def nbytes(self, kv: Any) -> int: ...

    def encode(self, kv: Any) -> tuple[list[int], bytes]:
        """The copy's shape and file bytes (the writer thread)."""
        ...

    def read(self, path: Path) -> Any: ...

    def describe(self, kv: Any) -> tuple[list[int], str]:
        """Shape and dtype name of what `read` returned."""
        ...

    def join(self, parts: list[Any]) -> Any:
        """What `read` returned for consecutive chunks, as one copy of all their blocks."""
        ...


@dataclass(slots=True)
class _Turn:
    session_id: str
    token_ids: list[int]
    kept: list[Chunk]  # of the copy the tier holds, still valid for this turn
    parts: list[tuple[int, int, Any]]  # (first block, blocks, copy): the chunks to write
    nbytes: int
    last_used: float
    published: float  # monotonic: when the oldest turn this one replaced ended


@dataclass(slots=True)
class TierStats:
    writes: int = 0
    reads: int = 0
    write_failures: int = 0
    superseded: int = 0  # writes skipped: the tier already held a later turn
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


class SessionTier:
    def __init__(
        self,
        layout: KVLayout,
        folder: str | Path,
        codec: KVCodec,
        max_pending_bytes: int = 256 * MiB,
    ) -> None:
        self.layout = layout
        self.codec = codec
        self.max_pending_bytes = max_pending_bytes
        self.dir = Path(folder).expanduser() / layout.key()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = TierStats()
        self._pending: dict[str, _Turn] = {}  # insertion order: oldest first
        self._held: OrderedDict[str, Held] = OrderedDict()  # last written or read here
        self._pending_bytes = 0
        self._writing = False
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._sweep()

    # -- writing (publish on the step thread; files on the writer thread) -------------------
    def publish(
        self, session_id: str, token_ids: list[int], block_ids: list[int], last_used: float
    ) -> None:
        """Queue the session's KV (`block_ids` hold `token_ids`) for the tier: a copy of the
        blocks the tier does not hold yet, as a chunk of full blocks and one of the last,
        partly filled block."""
        with self._cond:
            held = self._held.get(session_id)
        kept = reusable(held, token_ids, self.layout.block_size)
        first = sum(c.num_blocks for c in kept)
        full = len(token_ids) // self.layout.block_size
        bounds = [first, max(first, full), len(block_ids)]
        parts = [
            (lo, hi - lo, self.codec.snapshot(block_ids[lo:hi]))
            for lo, hi in pairwise(bounds)
            if hi > lo
        ]
        nbytes = sum(self.codec.nbytes(kv) for _, _, kv in parts)
        turn = _Turn(session_id, list(token_ids), kept, parts, nbytes, last_used, time.monotonic())
        with self._cond:
            while self._pending and self._pending_bytes + turn.nbytes > self.max_pending_bytes:
                self._cond.wait(1.0)
            old = self._pending.get(session_id)
            if old is not None:
                turn.published = old.published
                self._pending_bytes -= old.nbytes
            self._pending[session_id] = turn
            self._pending_bytes += turn.nbytes
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_all, name="shoal-session-tier", daemon=True
                )
                self._writer.start()

    @property
    def pending(self) -> int:
        return len(self._pending) + self._writing

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued turn is written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

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
                written = self._write(turn)
            except Exception as e:  # a full or unreachable share: the turn is not in the tier
                written = None
                self.stats.write_failures += 1
                warnings.warn(
                    f"session {turn.session_id!r}: not written to the session tier: {e}",
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
        """Write one turn; False if the tier already holds a later turn of it."""
        current = self._manifest(turn.session_id)
        if current is not None and supersedes(current.token_ids, turn.token_ids):
            return False
        if any(not (self.dir / c.file).exists() for c in turn.kept):
            with self._cond:
                self._held.pop(turn.session_id, None)  # the next turn is written whole
            raise FileNotFoundError("chunks it builds on were removed by another writer")
        key = session_key(turn.session_id)
        chunks: list[Chunk] = []
        staged = self.dir / f"{key}.{uuid.uuid4().hex[:12]}.manifest"
        try:
            for first, count, kv in turn.parts:
                _, data = self.codec.encode(kv)
                chunk = Chunk(
                    f"{key}.{uuid.uuid4().hex[:12]}.safetensors",
                    first,
                    count,
                    checksum(data),
                    len(data),
                )
                chunks.append(chunk)
                write_synced(self.dir / chunk.file, data)
            manifest = TierManifest(
                version=TIER_VERSION,
                session_id=turn.session_id,
                token_ids=turn.token_ids,
                fingerprint=self.layout.fingerprint,
                dtype=self.layout.dtype,
                block_size=self.layout.block_size,
                chunks=[*turn.kept, *chunks],
                last_used=turn.last_used,
            )
            write_synced(staged, json.dumps(asdict(manifest)).encode())
            os.replace(staged, self.dir / manifest_name(turn.session_id))
        except OSError:
            for chunk in chunks:
                (self.dir / chunk.file).unlink(missing_ok=True)
            staged.unlink(missing_ok=True)
            raise
        fsync_dir(self.dir)  # the chunks' names and the manifest's, at once
        self._hold(manifest)
        if current is not None:
            for name in current.files - manifest.files:
                (self.dir / name).unlink(missing_ok=True)
        return True

    # -- reading (the step thread) -----------------------------------------------------------
    def _manifest(self, session_id: str) -> TierManifest | None:
        return read_manifest(self._manifest_path(session_id))

    def _manifest_path(self, session_id: str) -> Path:
        return self.dir / manifest_name(session_id)

    def peek(self, session_id: str) -> TierManifest | None:
        """The session's copy in the tier, checked against this engine's layout; None if there
        is none or it cannot be used."""
        path = self._manifest_path(session_id)
        try:
            return check_manifest(path, self.layout)
        except FileNotFoundError:
            return None
        except Exception as e:  # another model's, damaged, or replaced while being read
            warnings.warn(f"session {session_id!r}: tier copy not used: {e}", stacklevel=2)
            return None

    def load(self, manifest: TierManifest) -> Any | None:
        """The KV a `peek`ed manifest names, every chunk checked whole; None (warned) if
        unusable."""
        try:
            kv = self.codec.join([self._chunk(c) for c in manifest.chunks])
        except Exception as e:
            warnings.warn(
                f"session {manifest.session_id!r}: tier copy not used: {e}; recomputing",
                stacklevel=2,
            )
            return None
        self._hold(manifest)
        self.stats.reads += 1
        return kv

    def _hold(self, manifest: TierManifest) -> None:
        held = Held.of(manifest)
        with self._cond:
            self._held[manifest.session_id] = held
            self._held.move_to_end(manifest.session_id)
            if len(self._held) > HELD_SESSIONS:
                self._held.popitem(last=False)  # its next turn is written whole

    def _chunk(self, chunk: Chunk) -> Any:
        path = self.dir / chunk.file
        verify_tensor_file(chunk, path)
        kv = self.codec.read(path)
        shape, dtype = self.codec.describe(kv)
        if shape != self.layout.shape(chunk.num_blocks * self.layout.block_size):
            raise CacheCorruptionError(f"unexpected chunk shape {shape}")
        if dtype != self.layout.dtype:
            raise CacheCorruptionError(f"unexpected chunk dtype {dtype}")
        return kv

    def delete(self, session_id: str) -> None:
        """Forget the session in the tier (its queued turn too)."""
        with self._cond:
            turn = self._pending.pop(session_id, None)
            if turn is not None:
                self._pending_bytes -= turn.nbytes
            self._held.pop(session_id, None)
        current = self._manifest(session_id)
        self._manifest_path(session_id).unlink(missing_ok=True)
        for name in current.files if current is not None else ():
            (self.dir / name).unlink(missing_ok=True)

    # -- start-up ------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Remove what writers that died left behind, once no live writer can still own it."""
        cutoff = time.time() - SWEEP_AGE_S
        live = {f for m in map(read_manifest, self.dir.glob("*.json")) if m for f in m.files}
        for path in self.dir.iterdir():
            stale = path.suffix in (".tmp", ".manifest") or (
                path.suffix == ".safetensors" and path.name not in live
            )
            try:
                if stale and path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)
            except OSError:
                pass
