"""Maps sequences onto the block pool: prefix hits, slot allocation, caching and freeing.

With sessions, a finished request's computed KV is handed to its session instead of freed; the
next turn reuses the longest common token prefix (full blocks by reference, a partial block
copied on write). When blocks run short, idle sessions are evicted least recently used first,
spilled to the disk tier, before the scheduler has to preempt anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shoal.engine.block_pool import BlockPool
from shoal.engine.hashing import chain_hashes
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.engine.sessions import Session, SessionIO, SessionTable, common_prefix_len


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class PrefixHit:
    """KV an admission reuses: full blocks shared by reference, then maybe one partial block."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    copy_src: int | None = None  # holds the partial run past `blocks`; copied on write
    session: Session | None = None  # the session lending the blocks: never evicted meanwhile


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        root: bytes,
        enable_prefix_caching: bool = True,
        sessions: SessionTable | None = None,
        io: SessionIO | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()
        self.sessions = sessions if sessions is not None else SessionTable()
        self.io = io

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

    def find_prefix(self, seq: Sequence, use_session: bool = True) -> PrefixHit:
        """The longest reusable prefix of `seq`: from the prefix cache or from its session.

        A session on disk only is restored into the pool first, when that pays.
        """
        blocks = self.find_cached_prefix(seq)
        hit = PrefixHit(blocks, len(blocks) * self.block_size)
        session = self.sessions.get(seq.session_id) if seq.session_id and use_session else None
        if session is None or not session.token_ids:
            return hit
        n = min(common_prefix_len(session.token_ids, seq.token_ids()), seq.num_tokens - 1)
        if n == 0 or n < hit.num_tokens or (n == hit.num_tokens and not session.resident):
            return hit  # restoring from disk would not pay
        if not session.resident and not self._restore(session):
            return hit
        full, partial = divmod(n, self.block_size)
        copy_src = session.block_ids[full] if partial else None
        return PrefixHit(session.block_ids[:full], n, copy_src, session)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Give `seq` room for `num_new_tokens` more tokens after its hits; False if it won't fit.

        On success the hit blocks join the table and `num_computed_tokens` covers them.
        """
        hits = hits or []
        hit = PrefixHit(hits, len(hits) * self.block_size)
        return self.allocate_hit(seq, num_new_tokens, hit, evict_pinned=True)

    def allocate_hit(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit, evict_pinned: bool = False
    ) -> bool:
        """`allocate` for a `PrefixHit`: idle sessions are evicted if blocks run short.

        `evict_pinned` (a running request growing) may also evict the sessions of running
        requests: what they still hold beyond the blocks lent to their request, which keeps
        its own reference, is better spilled than a request preempted.
        """
        covered = seq.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(covered) - len(seq.block_table) - len(hit.blocks)
        self.pool.touch(hit.blocks)  # held from here on, so no eviction below can take them
        if num_new_blocks > self.pool.num_free and not self.make_room(
            num_new_blocks, hit.session, evict_pinned
        ):
            self.pool.free(reversed(hit.blocks))
            return False
        seq.block_table.extend(hit.blocks)
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            if hit.copy_src is not None:
                assert self.io is not None, "a partial session hit needs a SessionIO"
                self.io.copy_block(hit.copy_src, new[0])
            seq.block_table.extend(new)
        seq.num_computed_tokens += hit.num_tokens
        return True

    def record_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.prefix_stats.queried_tokens += seq.num_tokens
        self.prefix_stats.hit_tokens += num_hit_tokens
        if seq.session_id is not None:
            stats = self.sessions.stats
            stats.tokens_reused += num_hit_tokens
            stats.tokens_recomputed += seq.num_tokens - num_hit_tokens

    # -- sessions ------------------------------------------------------------------------
    def pin(self, seq: Sequence, hit: PrefixHit) -> None:
        """`seq` joined the running batch: its session may not be evicted until it leaves."""
        session = self.sessions.get(seq.session_id) if seq.session_id else None
        if session is not None:
            session.running = True
            session.last_used = time.time()
        if hit.session is not None and seq.num_preemptions == 0:
            self.sessions.stats.hits += 1

    def make_room(
        self, num_blocks: int, protect: Session | None = None, evict_pinned: bool = False
    ) -> bool:
        """Evict sessions, idle ones least recently used first, until `num_blocks` are free."""
        while self.pool.num_free < num_blocks:
            victim = self.sessions.lru(protect) or (
                self.sessions.lru(protect, pinned=True) if evict_pinned else None
            )
            if victim is None:
                return False
            self.evict_session(victim)
        return True

    def evict_session(self, session: Session) -> None:
        """Spill a session's KV to disk (unless already there) and give its blocks back."""
        if not session.saved and self.io is not None and self.io.save(session):
            session.on_disk = session.saved = True
        self.pool.free(reversed(session.block_ids))
        session.block_ids = []
        if not session.saved:
            self.sessions.drop(session.session_id)  # lost: its next turn recomputes

    def drop_session(self, session_id: str) -> Session | None:
        """Forget a session's KV in memory (a running request of it keeps its own blocks)."""
        session = self.sessions.drop(session_id)
        if session is not None:
            self.pool.free(reversed(session.block_ids))
            session.block_ids = []
        return session

    def _restore(self, session: Session) -> bool:
        """Bring a session's disk copy back into the pool; False if no room or it is unusable."""
        num_blocks = self.blocks_needed(len(session.token_ids))
        if self.io is None or not session.on_disk or not self.make_room(num_blocks, session):
            return False
        start = time.perf_counter()
        data = self.io.load(session)
        if data is None:  # corrupt or mismatched: discarded (with a warning), so recompute
            session.token_ids = []
            session.on_disk = session.saved = False
            return False
        session.block_ids = self.pool.allocate(num_blocks)
        self.io.restore(data, session.block_ids)
        self.sessions.stats.restore_latencies.append(time.perf_counter() - start)
        return True

    def _retain(self, seq: Sequence, session: Session) -> None:
        """Hand `seq`'s computed KV to its session, replacing what the session held."""
        n = seq.num_computed_tokens
        keep = self.blocks_needed(n)
        old = session.block_ids
        session.block_ids, seq.block_table = seq.block_table[:keep], seq.block_table[keep:]
        session.token_ids = seq.tokens_slice(0, n)
        session.saved = False
        session.last_used = time.time()
        self.pool.free(reversed(old))

    def commit(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV is now computed."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_committed_blocks:
            return
        self._update_hashes(seq)
        for i in range(seq.num_committed_blocks, num_full):
            self.pool.cache(seq.block_table[i], seq.block_hashes[i])
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence, keep: bool = False) -> None:
        """Give `seq`'s blocks back; with `keep`, its session takes over its computed KV."""
        if seq.session_id is not None and seq.status is SequenceStatus.RUNNING:
            session = self.sessions.get(seq.session_id)
            if keep and seq.num_computed_tokens > 0:
                session = session or self.sessions.get_or_create(seq.session_id)
                self._retain(seq, session)
            if session is not None:
                session.running = False
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
