"""The shared session tier: each finished turn's session KV, written behind to a folder that
several engines share (the replicas of a cluster, or an engine and its successor after a
kill -9), so that the next engine to serve a session restores it instead of recomputing.

No torch here: a `KVCodec` (the torch `SessionStore`) copies blocks and turns them into bytes.

- Write-behind. When a turn ends, the step thread takes a CPU copy of the session's blocks
  (`publish`, before the answer leaves the engine) and a writer thread turns it into a file.
  A newer turn of a session replaces its older one in the queue, keeping the older one's place
  (and so its age). When the queued copies reach `max_pending_bytes`, `publish` waits: the
  engine slows to the storage's pace instead of the lag growing without bound. `stats` keeps
  each write's lag (turn end to durable file).
- Files. The layout of `session_files` (a folder per `KVLayout.key()`, `<session key>.json`
  and `<session key>.<nonce>.safetensors`, the same manifest and XXH3 checksum): the tensor
  file goes first under its own fresh name, then the manifest, staged under a fresh name and
  renamed over the old one, so a reader on any machine sees the old pair or the new one.
- Many writers. A copy is never replaced by an older turn of the same conversation (one whose
  tokens are a prefix of the stored ones). Nothing a reader cannot use is deleted by it (it may
  be another engine's write in flight); leftovers of writers that died are swept once they are
  an hour old.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shoal.durable import atomic_write, fsync_dir
from shoal.engine.session_files import (
    VERSION,
    KVLayout,
    Manifest,
    check_manifest,
    checksum,
    read_tensor,
    session_key,
    verify_tensor_file,
)

MiB = 1 << 20
SWEEP_AGE_S = 3600.0  # a leftover this old belongs to no live writer


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


@dataclass(slots=True)
class _Turn:
    session_id: str
    token_ids: list[int]
    kv: Any
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
        self._pending_bytes = 0
        self._writing = False
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._sweep()

    # -- writing (publish on the step thread; files on the writer thread) -------------------
    def publish(
        self, session_id: str, token_ids: list[int], block_ids: list[int], last_used: float
    ) -> None:
        """Queue the session's KV (`block_ids` hold `token_ids`) for the tier."""
        kv = self.codec.snapshot(block_ids)
        turn = _Turn(
            session_id, list(token_ids), kv, self.codec.nbytes(kv), last_used, time.monotonic()
        )
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
        shape, data = self.codec.encode(turn.kv)
        key, nonce = session_key(turn.session_id), uuid.uuid4().hex[:12]
        manifest = Manifest(
            version=VERSION,
            session_id=turn.session_id,
            token_ids=turn.token_ids,
            fingerprint=self.layout.fingerprint,
            dtype=self.layout.dtype,
            block_size=self.layout.block_size,
            shape=shape,
            tensor_file=f"{key}.{nonce}.safetensors",
            checksum=checksum(data),
            nbytes=len(data),
            last_used=turn.last_used,
        )
        staged = self.dir / f"{key}.{nonce}.manifest"
        try:
            atomic_write(self.dir / manifest.tensor_file, data)
            atomic_write(staged, json.dumps(asdict(manifest)).encode())
            os.replace(staged, self.dir / f"{key}.json")
        except OSError:
            (self.dir / manifest.tensor_file).unlink(missing_ok=True)
            staged.unlink(missing_ok=True)
            raise
        fsync_dir(self.dir)
        if current is not None and current.tensor_file != manifest.tensor_file:
            (self.dir / current.tensor_file).unlink(missing_ok=True)
        return True

    # -- reading (the step thread) -----------------------------------------------------------
    def _manifest(self, session_id: str) -> Manifest | None:
        """The stored manifest as written (unchecked): enough to order writes and clean up."""
        return _read_manifest(self._manifest_path(session_id))

    def _manifest_path(self, session_id: str) -> Path:
        return self.dir / f"{session_key(session_id)}.json"

    def peek(self, session_id: str) -> Manifest | None:
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

    def load(self, manifest: Manifest) -> Any | None:
        """The KV a `peek`ed manifest names, checked whole; None (warned) if unusable."""
        path = self.dir / manifest.tensor_file
        try:
            verify_tensor_file(manifest, path)
            kv = read_tensor(manifest, path, self.codec.read, self.codec.describe)
        except Exception as e:
            warnings.warn(
                f"session {manifest.session_id!r}: tier copy not used: {e}; recomputing",
                stacklevel=2,
            )
            return None
        self.stats.reads += 1
        return kv

    def delete(self, session_id: str) -> None:
        """Forget the session in the tier (its queued turn too)."""
        with self._cond:
            turn = self._pending.pop(session_id, None)
            if turn is not None:
                self._pending_bytes -= turn.nbytes
        current = self._manifest(session_id)
        self._manifest_path(session_id).unlink(missing_ok=True)
        if current is not None:
            (self.dir / current.tensor_file).unlink(missing_ok=True)

    # -- start-up ------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Remove what writers that died left behind, once no live writer can still own it."""
        cutoff = time.time() - SWEEP_AGE_S
        live = {m.tensor_file for m in map(_read_manifest, self.dir.glob("*.json")) if m}
        for path in self.dir.iterdir():
            stale = path.suffix in (".tmp", ".manifest") or (
                path.suffix == ".safetensors" and path.name not in live
            )
            try:
                if stale and path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)
            except OSError:
                pass


def _read_manifest(path: Path) -> Manifest | None:
    try:
        return Manifest(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
