"""A pool of fixed-size KV blocks with reference counts and LRU reuse.

Free blocks wait in an ordered queue: the head is reused (and its cached contents evicted)
first. A block whose contents are cached goes to the tail when freed, so cached prefixes
outlive scratch blocks, which go to the head. A block with `ref_cnt > 0` is referenced (by a
running request or a session) and can never be evicted.

The pool is the top tier of the KV store (`block_store.py`): when it reuses a cached block it
hands the block to `on_evict` first, which copies the KV down to host memory, so a cached
prefix is demoted, not lost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shoal.errors import PoolExhaustedError


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` tokens hold `a` tokens."""
    return -(-a // b)


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # Called with (block id, hash) pairs just before their cached contents are dropped.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, h: bytes) -> int | None:
        return self._cached.get(h)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, evicting what they cached."""
        if n > len(self._free):
            raise PoolExhaustedError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                evicted.append((block_id, block.hash))
                del self._cached[block.hash]
                block.hash = None
            block.ref_cnt = 1
            out.append(block_id)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)  # nothing has written into them yet
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), unlinking idle ones from the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; pass a table tail-first so tails are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of KV block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, h: bytes) -> None:
        """Publish a full, computed block under its chained hash (first writer wins)."""
        block = self.blocks[block_id]
        if block.hash is None and h not in self._cached:
            block.hash = h
            self._cached[h] = block_id

    def cached(self) -> list[tuple[bytes, int]]:
        """Every (hash, block id) whose contents are cached."""
        return list(self._cached.items())

    def evict_cached(self) -> None:
        """Drop every cached prefix that no running request holds (demoted, like any
        eviction)."""
        evicted = [(b, h) for b in self._free if (h := self.blocks[b].hash) is not None]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for block_id, h in evicted:
            del self._cached[h]
            self.blocks[block_id].hash = None
