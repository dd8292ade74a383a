"""The host-memory tier of the KV store (pure Python): block hash -> payload, bounded in bytes.

Blocks the pool evicts land here (a memcpy on the step thread), and blocks read back from disk
or the shared folder stay here too, so a block that goes back and forth costs one copy. Least
recently used unpinned blocks leave first (to the disk tier, by the caller); pinned ones only
when nothing else is left.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from shoal.engine.pins import Pins

Payload = Any  # bytes-like: the backend codec's block bytes (bytes, a numpy array, ...)


def nbytes(payload: Payload) -> int:
    return memoryview(payload).nbytes


class HostTier:
    def __init__(self, cap_bytes: int, pins: Pins) -> None:
        self.cap_bytes = cap_bytes
        self.pins = pins
        self.stored_bytes = 0
        self._blocks: OrderedDict[bytes, Payload] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    def get(self, h: bytes) -> Payload | None:
        with self._lock:
            payload = self._blocks.get(h)
            if payload is not None:
                self._blocks.move_to_end(h)
            return payload

    def touch(self, h: bytes) -> bool:
        with self._lock:
            if h not in self._blocks:
                return False
            self._blocks.move_to_end(h)
            return True

    def put(self, items: list[tuple[bytes, Payload]]) -> list[tuple[bytes, Payload]]:
        """Keep `items` (most recent last); returns what had to leave to stay under the cap,
        these items too when the cap cannot hold them."""
        out: list[tuple[bytes, Payload]] = []
        with self._lock:
            for h, payload in items:
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                self._blocks[h] = payload
                self.stored_bytes += nbytes(payload)
            while self.stored_bytes > self.cap_bytes and self._blocks:
                victim = next((k for k in self._blocks if not self.pins.pinned(k)), None)
                if victim is None:
                    victim = next(iter(self._blocks))
                h, payload = victim, self._blocks.pop(victim)
                self.stored_bytes -= nbytes(payload)
                out.append((h, payload))
        return out

    def discard(self, h: bytes) -> None:
        with self._lock:
            payload = self._blocks.pop(h, None)
            if payload is not None:
                self.stored_bytes -= nbytes(payload)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.stored_bytes = 0
