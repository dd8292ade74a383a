"""Maps sequences onto the block pool: prefix hits, slot allocation, caching and freeing.

A prefix is looked up by chained block hash in the pool and then, through the `BlockStore`,
in host memory, on disk and in the shared folder; blocks found below the pool are read
(`find_prefix`) and copied into fresh pool blocks on admission (`allocate_hit`), published
under their hashes again. With sessions, a finished request's computed KV is handed to its
session instead of freed; the next turn reuses the longest common token prefix (full blocks by
reference, the partly filled block copied on write). When blocks run short, idle sessions give
theirs back (least recently used first) before the scheduler has to preempt anything. Session
state itself is the `SessionManager`'s: this module only asks it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.block_store import BlockStore
from shoal.engine.hashing import chain_hashes
from shoal.engine.host_tier import Payload
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.engine.sessions import Session, SessionManager, common_prefix_len


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class PrefixHit:
    """KV an admission reuses: full blocks shared by reference (-1 where a block comes from
    below the pool: `loads`, in order), then maybe one partly filled block."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    loads: list[tuple[bytes, Payload]] = field(default_factory=list)  # (hash, KV) per -1
    copy_src: int | None = None  # pool block holding the partial run past `blocks`
    copy_load: Payload | None = None  # or its KV, read from below the pool
    session: Session | None = None  # the request's session: never evicted meanwhile
    tiers: set[str] = field(default_factory=set)  # where `loads` came from
    read_s: float = 0.0  # time spent reading them


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
        self.store: BlockStore | None = sessions.store if sessions is not None else None

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, seq: Sequence) -> None:
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = chain_hashes(
                self.root, seq.token_ids(), self.block_size, seq.block_hashes, seq.salt
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

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest reusable prefix of `seq`, in any tier: the chain of its cached full
        blocks (with prefix caching), or what its session holds, whichever is longer; a
        session's partly filled block too. KV found below the pool is read here."""
        bs = self.block_size
        full = (seq.num_tokens - 1) // bs if self.enable_prefix_caching else 0
        session, n = None, 0  # tokens the session holds of the prompt
        if self.sessions is not None and seq.session_id is not None:
            prompt = seq.token_ids()
            session = self.sessions.find(seq.session_id, prompt, seq.salt)
            if session is not None and session.token_ids and session.salt == seq.salt:
                n = min(common_prefix_len(session.token_ids, prompt), seq.num_tokens - 1)
                full = max(full, n // bs)
        hit = PrefixHit(session=session)
        if full == 0 and n == 0:
            return hit
        self._update_hashes(seq)
        wanted: list[bytes] = []
        for h in seq.block_hashes[:full]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                if self.store is None or self.store.where(h) is None:
                    break
                wanted.append(h)
                block_id = -1
            hit.blocks.append(block_id)
        partial = None
        if session is not None and n % bs and len(hit.blocks) == n // bs:
            partial = session.hashes[n // bs]  # holds the prompt's tokens up to `n`
            hit.copy_src = self.pool.lookup(partial)
            if hit.copy_src is None and (self.store is None or self.store.where(partial) is None):
                partial = None
        if wanted or (partial is not None and hit.copy_src is None):
            assert self.store is not None
            start = time.perf_counter()
            reads = wanted + ([partial] if partial is not None and hit.copy_src is None else [])
            got = self.store.fetch(reads)
            hit.read_s = time.perf_counter() - start
            hit.tiers = {tier for _, tier in got}
            hit.loads = [(h, kv) for h, (kv, _) in zip(wanted, got, strict=False)]
            if len(got) < len(wanted):  # a block could not be read: the hit ends before it
                hit.blocks = hit.blocks[: _nth(hit.blocks, -1, len(got))]
                partial = hit.copy_src = None
            elif len(got) > len(wanted):
                hit.copy_load = got[-1][0]
            elif hit.copy_src is None:
                partial = None
        hit.num_tokens = len(hit.blocks) * bs + (n % bs if partial is not None else 0)
        return hit

    def prefetch(self, seq: Sequence) -> None:
        """Start reading `seq`'s cached blocks on disk or in the shared folder into host
        memory, so its admission only copies (called as it arrives)."""
        store = self.store
        if store is None or not self.enable_prefix_caching or not (store.disk or store.shared):
            return
        self._update_hashes(seq)
        hashes = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
        store.prefetch([h for h in hashes if self.pool.lookup(h) is None])

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
        fit (idle sessions are spilled first). On success `num_computed_tokens` covers the hit:
        KV read from below the pool is copied into fresh blocks, published under its hashes.
        """
        covered = seq.num_computed_tokens + hit.num_tokens + num_new_tokens
        shared = [b for b in hit.blocks if b >= 0]
        num_new_blocks = self.blocks_needed(covered) - len(seq.block_table) - len(shared)
        held = shared + ([hit.copy_src] if hit.copy_src is not None else [])
        self.pool.touch(held)  # referenced from here on, so no eviction below takes them
        if num_new_blocks > self.pool.num_free and not (
            self.sessions is not None
            and self.sessions.make_room(num_new_blocks, hit.session, include_running)
        ):
            self.pool.free(reversed(held))
            return False
        new = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        loaded, rest = new[: len(hit.loads)], new[len(hit.loads) :]
        if loaded:
            assert self.store is not None
            self.store.codec.write_blocks(loaded, [kv for _, kv in hit.loads])
            for block_id, (h, _) in zip(loaded, hit.loads, strict=True):
                self.pool.cache(block_id, h)
        if hit.copy_src is not None:
            assert self.sessions is not None
            self.sessions.copy_block(hit.copy_src, rest[0])
            self.pool.free([hit.copy_src])
        elif hit.copy_load is not None:
            assert self.store is not None
            self.store.codec.write_blocks(rest[:1], [hit.copy_load])
        fill = iter(loaded)
        seq.block_table.extend(b if b >= 0 else next(fill) for b in hit.blocks)
        seq.block_table.extend(rest)
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
        reused = hit.num_tokens > 0 and seq.num_preemptions == 0
        if seq.num_preemptions == 0:
            stats = self.sessions.stats
            stats.tokens_reused += seq.num_computed_tokens
            stats.tokens_recomputed += seq.num_tokens - seq.num_computed_tokens
            if hit.tiers & {"disk", "shared"}:
                stats.disk_reads += 1
            stats.tier_reads += "shared" in hit.tiers
            if hit.tiers:
                stats.restore_latencies.append(hit.read_s)
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
        """Give `seq`'s blocks back; with `keep`, its session takes over its computed KV (and
        the prefixes it asked to keep are pinned in the store)."""
        if keep and seq.cache_pins and seq.status is SequenceStatus.RUNNING:
            self._pin(seq)
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

    def _pin(self, seq: Sequence) -> None:
        if self.store is None or not self.enable_prefix_caching:
            return
        self.commit(seq)
        for pin in seq.cache_pins:
            n = seq.num_computed_tokens
            hashes = seq.block_hashes[: min(n, pin.num_tokens or n) // self.block_size]
            if hashes:
                name = pin.name or f"prefix:{hashes[-1].hex()}"
                self.store.pins.pin(name, hashes, pin.ttl_s)


def _nth(items: list[int], value: int, n: int) -> int:
    """The index of the `n`-th (from 0) occurrence of `value` in `items`."""
    seen = -1
    for i, item in enumerate(items):
        seen += item == value
        if seen == n and item == value:
            return i
    return len(items)
