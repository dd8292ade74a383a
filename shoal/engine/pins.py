"""Named pins on stored KV blocks (pure Python): what the host and disk tiers evict last.

A pin names a run of block hashes: a session's blocks (`session:<id>`, no expiry), the
prefix of a request with a cache hint (`key:<prompt_cache_key>`, replaced by its next
request) or the prefix up to an Anthropic `cache_control` breakpoint (with its TTL, refreshed
when pinned again). The tiers evict unpinned blocks least recently used first and pinned ones
only when nothing else is left; an expired pin is dropped when next looked at.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CachePin:
    """What a request asks the store to keep once it ends: its KV up to `num_tokens` (all it
    computed when None), pinned under `name` (named after its last block when None) for
    `ttl_s` seconds (until replaced when None)."""

    name: str | None = None
    num_tokens: int | None = None
    ttl_s: float | None = None


@dataclass(slots=True)
class Pin:
    name: str
    hashes: tuple[bytes, ...]
    expires: float | None  # wall clock; None: until unpinned


class Pins:
    """Thread-safe: the step thread pins, the tiers' writer threads ask."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._pins: dict[str, Pin] = {}
        self._counts: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, name: str, hashes: Iterable[bytes], ttl_s: float | None = None) -> None:
        """Pin `hashes` under `name`, replacing what the name pinned before."""
        expires = None if ttl_s is None else self.clock() + ttl_s
        with self._lock:
            self._drop(name)
            pin = Pin(name, tuple(hashes), expires)
            self._pins[name] = pin
            for h in pin.hashes:
                self._counts[h] = self._counts.get(h, 0) + 1

    def unpin(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def _drop(self, name: str) -> None:
        pin = self._pins.pop(name, None)
        for h in pin.hashes if pin is not None else ():
            n = self._counts[h] - 1
            if n:
                self._counts[h] = n
            else:
                del self._counts[h]

    def pinned(self, h: bytes) -> bool:
        return h in self._counts

    def expire(self) -> list[str]:
        """Drop the pins whose time is up; returns their names."""
        now = self.clock()
        with self._lock:
            gone = [
                p.name for p in self._pins.values() if p.expires is not None and p.expires <= now
            ]
            for name in gone:
                self._drop(name)
        return gone

    def get(self, name: str) -> Pin | None:
        return self._pins.get(name)

    def items(self) -> list[Pin]:
        with self._lock:
            return list(self._pins.values())
