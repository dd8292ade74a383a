"""Maps sequences onto the block pool: prefix hits, slot allocation, caching and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.block_pool import BlockPool
from shoal.engine.hashing import chain_hashes
from shoal.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, pool: BlockPool, root: bytes, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, seq: Sequence) -> None:
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = chain_hashes(
                self.root, seq.token_ids(), self.block_size, seq.block_hashes
            )

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks at the start of `seq`.

        At most `num_tokens - 1` tokens hit, so the last token is always computed and there
        are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(seq)
        hits: list[int] = []
        for h in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Give `seq` room for `num_new_tokens` more tokens after its hits; False if it won't fit.

        On success the hit blocks join the table and `num_computed_tokens` covers them.
        """
        hits = hits or []
        covered = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(covered) - len(seq.block_table) - len(hits)
        idle_hits = sum(1 for b in hits if self.pool.blocks[b].ref_cnt == 0)
        if num_new_blocks + idle_hits > self.pool.num_free:
            return False
        if hits:
            self.pool.touch(hits)
            seq.block_table.extend(hits)
            seq.num_computed_tokens += len(hits) * self.block_size
        if num_new_blocks > 0:
            seq.block_table.extend(self.pool.allocate(num_new_blocks))
        return True

    def record_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.prefix_stats.queried_tokens += seq.num_tokens
        self.prefix_stats.hit_tokens += num_hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV is now computed."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_committed_blocks:
            return
        self._update_hashes(seq)
        for i in range(seq.num_committed_blocks, num_full):
            self.pool.cache(seq.block_table[i], seq.block_hashes[i])
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
