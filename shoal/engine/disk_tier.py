"""The local disk tier of the KV store (pure Python): block files under the cache dir, bounded
in bytes, written behind by a thread.

Blocks that leave host memory are queued here and written by one writer thread (a bounded
queue: an unpinned block is dropped when it is full, a pinned one waits, so the engine slows
to the disk's pace rather than losing a session). At start-up the index is rebuilt from the
files (least recently written first), so a restart finds every block a previous run left.
Least recently used unpinned blocks are deleted first; when only pinned ones are left, the
oldest pin is given up whole (named in `take_unpinned`, so the step thread forgets its
session), as a session used to be. Without a cache dir the files live in a private temporary folder.
"""

from __future__ import annotations

import tempfile
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from shoal.engine.block_files import HEADER, BlockFiles
from shoal.engine.host_tier import Payload
from shoal.engine.pins import Pins
from shoal.errors import CacheCorruptionError

MiB = 1 << 20


@dataclass(slots=True)
class _Write:
    payload: Payload
    pinned: bool


class DiskTier:
    def __init__(
        self,
        folder: Path | None,
        block_nbytes: int,
        cap_bytes: int,
        pins: Pins,
        max_pending_bytes: int = 256 * MiB,
    ) -> None:
        self.persistent = folder is not None
        self._tmp = None
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="shoal-kv-")
            folder = Path(self._tmp.name)
        self.files = BlockFiles(folder, block_nbytes)
        self.file_nbytes = HEADER.size + block_nbytes
        self.cap_bytes = cap_bytes
        self.pins = pins
        self.max_pending_bytes = max(max_pending_bytes, block_nbytes)
        self._unpinned_names: list[str] = []  # pins given up for room, not yet taken
        self.dropped = 0  # unpinned blocks not written: the queue was full
        self._index: OrderedDict[bytes, None] = OrderedDict()
        self._pending: OrderedDict[bytes, _Write] = OrderedDict()
        self._pending_bytes = 0
        self._writing: bytes | None = None
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        found = sorted(self.files.scan(), key=lambda f: f[2])
        for h, size, _ in found:
            if size == self.file_nbytes:
                self._index[h] = None
            else:  # a layout's blocks all have one size: anything else is damaged
                warnings.warn(f"KV block {h.hex()[:12]} on disk truncated; dropped", stacklevel=2)
                self.files.delete(h)
        self._enforce_cap()

    # -- queries ---------------------------------------------------------------------------
    @property
    def stored_bytes(self) -> int:
        return len(self._index) * self.file_nbytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, h: bytes) -> bool:
        return h in self._index or h in self._pending

    def hashes(self) -> list[bytes]:
        with self._cond:
            return [*self._index, *self._pending]

    def get(self, h: bytes) -> Payload | None:
        """Block `h`, checked; None if absent or damaged (a damaged file is deleted, warned)."""
        with self._cond:
            write = self._pending.get(h)
            if write is not None:
                return write.payload
            if h not in self._index:
                return None
            self._index.move_to_end(h)
        try:
            return self.files.read(h)
        except CacheCorruptionError as e:
            warnings.warn(
                f"KV block {h.hex()[:12]} on disk unusable ({e}); recomputing", stacklevel=2
            )
            self.delete(h)
            return None

    # -- writing ---------------------------------------------------------------------------
    def put(self, items: list[tuple[bytes, Payload]], wait: bool = False) -> None:
        """Queue blocks for the writer thread (those already here are only touched); when the
        queue is full a pinned block (any, with `wait`) waits for room, others are dropped."""
        with self._cond:
            for h, payload in items:
                if h in self._index:
                    self._index.move_to_end(h)
                    continue
                if h in self._pending:
                    continue
                pinned = wait or self.pins.pinned(h)
                while self._pending_bytes + self.file_nbytes > self.max_pending_bytes:
                    if not pinned:
                        break
                    self._start_writer()  # the queue drains only while it writes
                    self._cond.wait(1.0)
                else:
                    self._pending[h] = _Write(payload, pinned)
                    self._pending_bytes += self.file_nbytes
                    continue
                self.dropped += 1
            self._start_writer()

    def _start_writer(self) -> None:
        """Start the writer thread if blocks are queued and none runs (the lock is held)."""
        if self._pending and self._writer is None:
            self._writer = threading.Thread(
                target=self._write_all, name="shoal-kv-disk", daemon=True
            )
            self._writer.start()

    def flush(self, timeout: float = 120.0) -> bool:
        """Wait until every queued block is on disk; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._writing is None, timeout)

    def _write_all(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._writer = None
                    self._cond.notify_all()
                    return
                h, write = self._pending.popitem(last=False)
                self._writing = h
            try:
                self.files.write(h, write.payload, durable=False)
                ok = True
            except OSError as e:
                warnings.warn(f"KV block not written to disk: {e}", stacklevel=1)
                ok = False
            with self._cond:
                self._pending_bytes -= self.file_nbytes
                self._writing = None
                if ok:
                    self._index[h] = None
                self._cond.notify_all()
            if ok:
                self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Delete least recently used blocks, unpinned first, until under the cap."""
        for name in self.pins.expire():
            self._unpinned(name)
        while True:
            with self._cond:
                if self.stored_bytes <= self.cap_bytes or not self._index:
                    return
                h = next((k for k in self._index if not self.pins.pinned(k)), None)
                if h is not None:
                    del self._index[h]
            if h is not None:
                self.files.delete(h)
                continue
            oldest = next(iter(self.pins.items()), None)
            if oldest is None:
                with self._cond:
                    h = self._index.popitem(last=False)[0]
                self.files.delete(h)
            else:
                self.pins.unpin(oldest.name)
                self._unpinned(oldest.name)

    def _unpinned(self, name: str) -> None:
        with self._cond:
            self._unpinned_names.append(name)

    def take_unpinned(self) -> list[str]:
        """Names of the pins given up (expired, or for room) since the last call."""
        with self._cond:
            names, self._unpinned_names = self._unpinned_names, []
        return names

    def delete(self, h: bytes) -> None:
        with self._cond:
            self._index.pop(h, None)
        self.files.delete(h)
