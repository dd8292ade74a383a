"""Maps sequences onto the block pool: prefix hits, slot allocation, caching and freeing.

With sessions, a finished request's computed KV is handed to its session instead of freed; the
next turn reuses the longest common token prefix (full blocks by reference, a partial block
copied on write). When blocks run short, idle sessions are spilled to the disk tier (least
recently used first) before the scheduler has to preempt anything. Session state itself is the
`SessionManager`'s: this module only asks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.hashing import chain_hashes
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.engine.sessions import Session, SessionManager, SessionState, common_prefix_len


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
        sessions: SessionManager | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()
        self.sessions = sessions

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

        A spilled session is restored into the pool first, when that pays.
        """
        blocks = self.find_cached_prefix(seq)
        hit = PrefixHit(blocks, len(blocks) * self.block_size)
        if self.sessions is None or seq.session_id is None or not use_session:
            return hit
        prompt = seq.token_ids()
        session = self.sessions.find(seq.session_id, prompt)
        if session is None or not session.token_ids:
            return hit
        n = min(common_prefix_len(session.token_ids, prompt), seq.num_tokens - 1)
        if n == 0 or n < hit.num_tokens or (n == hit.num_tokens and not session.resident):
            return hit  # restoring from disk would not pay
        if session.state is SessionState.SPILLED and not self.sessions.restore(session):
            return hit
        full, partial = divmod(n, self.block_size)
        copy_src = session.block_ids[full] if partial else None
        return PrefixHit(session.block_ids[:full], n, copy_src, session)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Room for `num_new_tokens` more tokens of `seq` after its cached `hits`; False if it
        won't fit.

        Running sessions may spill what they hold beyond their requests' blocks first: that is
        better than preempting a running request.
        """
        hit = PrefixHit(hits or [], len(hits or []) * self.block_size)
        return self.allocate_hit(seq, num_new_tokens, hit, include_running=True)

    def allocate_hit(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit, include_running: bool = False
    ) -> bool:
        """Give `seq` its hit blocks and room for `num_new_tokens` after them; False if it won't
        fit (idle sessions are spilled first). On success `num_computed_tokens` covers the hit.
        """
        covered = seq.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(covered) - len(seq.block_table) - len(hit.blocks)
        self.pool.touch(hit.blocks)  # referenced from here on, so no eviction below takes them
        if num_new_blocks > self.pool.num_free and not (
            self.sessions is not None
            and self.sessions.make_room(num_new_blocks, hit.session, include_running)
        ):
            self.pool.free(reversed(hit.blocks))
            return False
        seq.block_table.extend(hit.blocks)
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            if hit.copy_src is not None:
                assert self.sessions is not None
                self.sessions.copy_block(hit.copy_src, new[0])
            seq.block_table.extend(new)
        seq.num_computed_tokens += hit.num_tokens
        return True

    def admitted(self, seq: Sequence, hit: PrefixHit) -> None:
        """`seq` joined the running batch: count its hit once, and pin its session."""
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_stats.queried_tokens += seq.num_tokens
            self.prefix_stats.hit_tokens += seq.num_computed_tokens
        if self.sessions is None or seq.session_id is None:
            return
        if seq.num_preemptions == 0:
            stats = self.sessions.stats
            stats.tokens_reused += seq.num_computed_tokens
            stats.tokens_recomputed += seq.num_tokens - seq.num_computed_tokens
        reused = hit.session is not None and seq.num_preemptions == 0
        self.sessions.start(seq.session_id, reused)

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
        if (
            self.sessions is not None
            and seq.session_id is not None
            and seq.status is SequenceStatus.RUNNING
        ):
            self.sessions.finish(seq, keep)
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
