"""One content-addressed KV store in tiers: the pool, host memory, local disk, a shared folder
(pure Python; a backend's `BlockCodec` moves the bytes).

Every tier is keyed by the restart-stable chained block hash (`hashing.py`), seeded with the
layout (model fingerprint, dtype, block size), so a key means one KV in any tier, after a
restart and on another machine. SGLang's HiCache is the model: one cache, several tiers.

    pool ──evict──▶ host ──LRU──▶ disk ──LRU──▶ (gone)          demotion (`demote`)
    pool ◀──────── host ◀──────── disk ◀─────── shared folder    promotion (`fetch`)

- Demotion: when the pool reuses a cached block, its KV is copied to host memory first (one
  memcpy, on the step thread); host memory overflows to the disk tier's write-behind queue.
- Promotion: a prefix lookup that runs out of pool hits goes on through host, disk and the
  shared folder (`where`), and the KV manager copies the blocks found into fresh pool blocks
  (`fetch` then `BlockCodec.write_blocks`), published under their hashes again. Blocks read
  from disk or the shared folder stay in host memory, and `prefetch` reads a waiting request's
  blocks into host memory on a thread, so admission usually only copies.
- Pins (`pins.py`) keep sessions' and cache hints' blocks in host and on disk longest.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from shoal.engine.block_files import KVLayout
from shoal.engine.block_pool import BlockPool
from shoal.engine.disk_tier import DiskTier
from shoal.engine.hashing import root_hash
from shoal.engine.host_tier import HostTier, Payload
from shoal.engine.pins import Pins

if TYPE_CHECKING:
    from shoal.engine.sessions import SessionManager
    from shoal.engine.shared_tier import SharedTier

TIERS = ("host", "disk", "shared")
PREFETCHED = 100_000


class BlockCodec(Protocol):
    """How a backend copies whole blocks out of its pool and back (torch: `kv_store`; MLX:
    `backends/mlx/kv.py`). A payload is bytes-like, `block_nbytes` long."""

    @property
    def block_nbytes(self) -> int: ...

    def read_blocks(self, block_ids: list[int]) -> list[Payload]:
        """A copy of each block's KV (the pool may reuse the blocks right after)."""
        ...

    def write_blocks(self, block_ids: list[int], payloads: list[Payload]) -> None: ...

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one pool block's KV into another (copy on write of a partial block)."""
        ...


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # lookups that found a block here (and not above)
    promotions: int = 0  # blocks copied from here back into the pool
    demotions: int = 0  # blocks copied down into this tier


@dataclass(slots=True)
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})


class BlockStore:
    def __init__(
        self,
        pool: BlockPool,
        codec: BlockCodec,
        host: HostTier,
        disk: DiskTier,
        shared: SharedTier | None = None,
    ) -> None:
        self.pool = pool
        self.codec = codec
        self.host = host
        self.disk = disk
        self.shared = shared
        self.pins = host.pins
        self.stats = StoreStats()
        self._prefetch: deque[list[bytes]] = deque()
        self._prefetched: dict[bytes, str] = {}  # read up ahead of use: the tier it came from
        self._prefetcher: threading.Thread | None = None  # runs only while there is work
        self._prefetch_lock = threading.Lock()
        pool.on_evict = self.demote

    # -- down --------------------------------------------------------------------------------
    def demote(self, evicted: list[tuple[int, bytes]]) -> None:
        """The pool is about to reuse these cached blocks: keep their KV in host memory."""
        if not (self.host.cap_bytes or self.disk.cap_bytes):
            return  # no tier below the pool: nothing to copy
        fresh = [(b, h) for b, h in evicted if not self.host.touch(h)]
        if not fresh:
            return
        payloads = self.codec.read_blocks([b for b, _ in fresh])
        self.stats.tiers["host"].demotions += len(fresh)
        self._to_host([(h, p) for (_, h), p in zip(fresh, payloads, strict=True)])

    def _to_host(self, items: list[tuple[bytes, Payload]]) -> None:
        overflow = [(h, p) for h, p in self.host.put(items) if h not in self.disk]
        if overflow:
            self.stats.tiers["disk"].demotions += len(overflow)
            self.disk.put(overflow)

    # -- up ----------------------------------------------------------------------------------
    def where(self, h: bytes) -> str | None:
        """The tier below the pool that holds block `h`, if any."""
        tier = None
        if h in self.host:
            tier = "host"
        elif h in self.disk:
            tier = "disk"
        elif self.shared is not None and self.shared.has(h):
            tier = "shared"
        if tier is not None:
            self.stats.tiers[tier].hits += 1
        return tier

    def fetch(self, hashes: list[bytes]) -> list[tuple[Payload, str]]:
        """The KV of the leading `hashes` that can be read (a missing or damaged block ends
        the run), each with the tier it came from; what came from disk or the shared folder
        stays in host memory."""
        out: list[tuple[Payload, str]] = []
        for h in hashes:
            got = self._read(h)
            if got is None:
                break
            out.append(got)
            self.stats.tiers[got[1]].promotions += 1
        return out

    def _read(self, h: bytes) -> tuple[Payload, str] | None:
        payload = self.host.get(h)
        if payload is not None:  # a prefetched block still counts for the tier it left
            return payload, self._prefetched.pop(h, "host")
        tier = "disk"
        payload = self.disk.get(h)
        if payload is None and self.shared is not None:
            tier, payload = "shared", self.shared.read(h)
        if payload is None:
            return None
        self._to_host([(h, payload)])
        return payload, tier

    def prefetch(self, hashes: list[bytes]) -> None:
        """Read the leading blocks of `hashes` that are on disk or in the shared folder into
        host memory, on a thread: a waiting request's admission then only copies."""
        if not hashes:
            return
        with self._prefetch_lock:
            self._prefetch.append(hashes)
            if self._prefetcher is None:
                self._prefetcher = threading.Thread(
                    target=self._prefetch_all, name="shoal-kv-prefetch", daemon=True
                )
                self._prefetcher.start()

    def _prefetch_all(self) -> None:
        """Read what is queued, then end: an idle thread would keep the store (and through
        the codec the model and its pool) alive after the engine closes."""
        while True:
            with self._prefetch_lock:
                if not self._prefetch:
                    self._prefetcher = None
                    return
                hashes = self._prefetch.popleft()
            for h in hashes:
                if h in self.host:
                    continue
                got = self._read(h)
                if got is None:
                    break
                if len(self._prefetched) > PREFETCHED:
                    self._prefetched.clear()  # never used: only the statistics forget them
                self._prefetched[h] = got[1]

    # -- persistence ---------------------------------------------------------------------------
    def write_back(self) -> int:
        """Put every block the pool caches or host memory holds on disk too (an idle engine,
        or one closing), so a restart finds every prefix; returns how many were queued."""
        items = [(h, b) for h, b in self.pool.cached() if h not in self.disk]
        step = max(1, self.disk.max_pending_bytes // self.disk.file_nbytes)
        for i in range(0, len(items), step):  # a copy of the whole pool at once would not fit
            part = items[i : i + step]
            payloads = self.codec.read_blocks([b for _, b in part])
            self.disk.put([(h, p) for (h, _), p in zip(part, payloads, strict=True)], wait=True)
        hosted = []
        for h in self.host.hashes():
            if h not in self.disk and (p := self.host.get(h)) is not None:
                hosted.append((h, p))
        self.disk.put(hosted, wait=True)
        self.stats.tiers["disk"].demotions += len(items) + len(hosted)
        self.disk.flush()
        return len(items) + len(hosted)

    def persist(self, hashes: list[bytes], block_ids: dict[bytes, int]) -> int:
        """Put the leading `hashes` on disk (from host memory, or from the pool blocks named in
        `block_ids`) and wait for them; returns how many are there."""
        queued = 0
        for h in hashes:
            if h not in self.disk:
                payload = self.host.get(h)
                if payload is None and h in block_ids:
                    payload = self.codec.read_blocks([block_ids[h]])[0]
                if payload is None:
                    break
                self.stats.tiers["disk"].demotions += 1
                self.disk.put([(h, payload)])
            queued += 1
        self.disk.flush()
        n = 0
        while n < queued and hashes[n] in self.disk:
            n += 1
        return n


def build_store(
    layout: KVLayout,
    pool: BlockPool,
    codec: BlockCodec,
    *,
    cache_dir: str | Path | None,
    host_kv_bytes: int,
    disk_kv_bytes: int,
    shared_dir: str | Path | None = None,
) -> tuple[BlockStore, SessionManager]:
    """The tiers below `pool` (host memory, disk under `cache_dir`, the shared folder), and
    the sessions pinned on them: both backends build theirs here."""
    from shoal.engine.session_manifests import SessionManifests
    from shoal.engine.sessions import SessionManager
    from shoal.engine.shared_tier import SharedTier

    root = root_hash(layout.root())
    cache = Path(cache_dir).expanduser() if cache_dir else None
    pins = Pins()
    disk = DiskTier(
        cache / layout.key() / "blocks" if cache else None,
        codec.block_nbytes,
        disk_kv_bytes,
        pins,
    )
    shared = SharedTier(layout, shared_dir, codec, root) if shared_dir else None
    store = BlockStore(pool, codec, HostTier(host_kv_bytes, pins), disk, shared)
    sessions = SessionManager(pool, store, root, SessionManifests(cache, layout), shared)
    return store, sessions
