"""Agent sessions: named pins on the KV store (pure Python, no torch).

A session is the token ids of its last turn and the keys of the blocks holding their KV
(`hashing.session_hashes`: the full blocks' chain, then the partly filled last block), pinned
in the store (`pins.py`) so host memory and disk keep them longest. While its KV is in the pool
the session also holds one reference on each block, so idle session KV is not churned by the
prefix cache (SGLang's `lock_ref`). `SessionManager` is the only writer of session state; a
session is always in one of three states:

    RUNNING   one of its requests is in the running batch: the session is *pinned*
    RESIDENT  idle, its KV in the pool: evictable, least recently used first
    SPILLED   idle, its blocks in the store below the pool (host memory, disk, the shared
              folder): a turn that reuses it promotes them back (`KVCacheManager.find_prefix`)

    (new) ──start──▶ RUNNING ──finish──▶ RESIDENT ──evict──▶ SPILLED
                        ▲    ╰─finish (nothing in the pool)────▶ │
                        ╰────────────── start ◀───────────────────┤ (RESIDENT too)
    manifest scan at start-up ──▶ SPILLED;  drop / its pin given up for disk room ──▶ (gone)

(A *block* is referenced, a *session* is running or pinned: the words are not mixed.) Spilling
a session only drops its references: its blocks stay cached in the pool and are demoted to host
memory when the pool reuses them, so memory pressure costs no disk write on the step thread. A
running session's request holds its own reference on every block it uses, so what the session
holds beyond those can still be spilled (`make_room(..., include_running=True)`) when the only
alternative is preempting a running request.

Persisting a session (`flush`: on close, and when an idle server saves) puts its blocks on disk
and writes a small manifest (`session_manifests.py`): blocks shared by many sessions are stored
once. With a `SharedTier` (`shared_tier.py`), every finished turn is also written behind to a
folder other engines share, and an idle session is looked up there: a copy that covers more of
the new prompt than this engine's is adopted (SPILLED) and its blocks read from there.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.block_store import BlockStore
from shoal.engine.hashing import Salt, session_hashes
from shoal.engine.sequence import Sequence
from shoal.engine.session_manifests import SessionManifests

if TYPE_CHECKING:
    from shoal.engine.shared_tier import SharedTier


class SessionState(enum.Enum):
    RUNNING = "running"
    RESIDENT = "resident"
    SPILLED = "spilled"


_LEGAL = {
    (SessionState.RUNNING, SessionState.RESIDENT),
    (SessionState.RUNNING, SessionState.SPILLED),
    (SessionState.RESIDENT, SessionState.RUNNING),
    (SessionState.RESIDENT, SessionState.SPILLED),
    (SessionState.SPILLED, SessionState.RUNNING),
    (SessionState.SPILLED, SessionState.RESIDENT),  # restored by an admission that then waits
}


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    state: SessionState
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the session holds
    hashes: list[bytes] = field(default_factory=list)  # keys of the blocks holding them
    block_ids: list[int] = field(default_factory=list)  # in-pool KV; empty when not resident
    last_used: float = field(default_factory=time.time)  # wall clock: it is persisted
    saved: bool = False  # a manifest of exactly `token_ids` is on disk, with its blocks
    salt: Salt | None = None  # the salt its hashes were computed with (its last turn's)

    @property
    def resident(self) -> bool:
        return bool(self.block_ids)

    @property
    def running(self) -> bool:
        return self.state is SessionState.RUNNING


@dataclass(slots=True)
class SessionInfo:
    """What `llm.sessions` shows about one session."""

    session_id: str
    state: str
    num_tokens: int
    num_blocks: int  # blocks resident in the pool
    in_memory: bool
    on_disk: bool
    saved: bool  # the disk copy is up to date
    running: bool
    last_used: float


@dataclass(slots=True)
class SessionStats:
    hits: int = 0  # admissions that reused some of their session's KV
    tokens_reused: int = 0  # prompt tokens of session requests served from session KV
    tokens_recomputed: int = 0  # prompt tokens of session requests that were computed
    disk_reads: int = 0  # admissions that read session KV back from disk or the shared folder
    disk_writes: int = 0  # sessions persisted (blocks on disk, then the manifest)
    tier_reads: int = 0  # admissions that read session KV from the shared folder
    restore_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))

    def restore_percentile(self, q: float) -> float:
        """The q-quantile of recent restores (reads below the pool), in seconds."""
        if not self.restore_latencies:
            return 0.0
        values = sorted(self.restore_latencies)
        return values[min(len(values) - 1, int(q * len(values)))]


PIN = "session:"


class SessionManager:
    def __init__(
        self,
        pool: BlockPool,
        store: BlockStore,
        root: bytes,
        manifests: SessionManifests,
        shared: SharedTier | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.root = root
        self.manifests = manifests
        self.shared = shared
        self.stats = SessionStats()
        self._sessions: dict[str, Session] = {}
        for m in manifests.scan():
            session = Session(m.session_id, SessionState.SPILLED, last_used=m.last_used)
            self._take_tokens(session, m.token_ids, salt=m.cache_salt())
            session.saved = True
            self._sessions[m.session_id] = session

    # -- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def find(self, session_id: str, prompt: list[int], salt: Salt | None = None) -> Session | None:
        """The session whose KV a turn with `prompt` and `salt` should reuse: the one held
        here, unless it is idle and the shared folder holds a copy with that salt covering more
        of `prompt` (another engine served the later turns, or this one died before saving):
        that copy is adopted, even over an older turn in this pool. Reading a token's KV costs
        far less than recomputing it (SmolLM2 in float32: 46 KB against ~0.27 GFLOP). A
        session whose salt is not `salt` is returned, but its KV is not reused."""
        self._forget_unpinned()
        session = self._sessions.get(session_id)
        if self.shared is None or (session is not None and session.running):
            return session
        copy = self.shared.peek(session_id)
        if copy is None or copy.cache_salt() != salt:
            return session
        if (
            session is not None
            and session.salt == salt
            and common_prefix_len(session.token_ids, prompt)
            >= common_prefix_len(copy.token_ids, prompt)
        ):
            return session
        if session is None:
            session = self._sessions[session_id] = Session(session_id, SessionState.SPILLED)
        elif session.resident:  # an older turn in the pool: its blocks go back, as cached blocks
            self.pool.free(reversed(session.block_ids))
            session.block_ids = []
            self._move(session, SessionState.SPILLED)
        self._take_tokens(session, copy.token_ids, salt=salt)
        session.saved = False
        return session

    def infos(self) -> list[SessionInfo]:
        """Every session held in memory or on disk, most recently used first."""
        return sorted((self.info(s) for s in self._sessions.values()), key=lambda i: -i.last_used)

    def info_of(self, session_id: str) -> SessionInfo | None:
        session = self._sessions.get(session_id)
        return self.info(session) if session is not None else None

    def info(self, session: Session) -> SessionInfo:
        return SessionInfo(
            session_id=session.session_id,
            state=session.state.value,
            num_tokens=len(session.token_ids),
            num_blocks=len(session.block_ids),
            in_memory=session.resident,
            on_disk=session.saved,
            saved=session.saved,
            running=session.running,
            last_used=session.last_used,
        )

    def _move(self, session: Session, to: SessionState) -> None:
        assert (session.state, to) in _LEGAL, f"session {session.state} -> {to}"
        session.state = to

    def _take_tokens(
        self,
        session: Session,
        token_ids: list[int],
        known: Seq[bytes] = (),
        salt: Salt | None = None,
    ) -> None:
        """Make `token_ids` (hashed with `salt`) the session's KV, pinned in the store under
        the session's name."""
        session.token_ids = list(token_ids)
        session.salt = salt
        session.hashes = session_hashes(self.root, token_ids, self.pool.block_size, known, salt)
        self.store.pins.pin(PIN + session.session_id, session.hashes)

    # -- a turn's life -------------------------------------------------------------------------
    def start(self, session_id: str, reused: bool) -> None:
        """A request of the session joined the running batch: pin the session."""
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(session_id, SessionState.RUNNING)
        else:
            self._move(session, SessionState.RUNNING)
        session.last_used = time.time()
        self.stats.hits += reused

    def finish(self, seq: Sequence, keep: bool) -> None:
        """The session's request left the batch. With `keep`, the session takes over the
        request's computed KV (the blocks move from `seq.block_table`, published under their
        keys); otherwise (an abort) it keeps what it had."""
        assert seq.session_id is not None
        session = self._sessions.get(seq.session_id)
        if session is None:  # dropped while its request ran: this turn starts it afresh
            if not (keep and seq.num_computed_tokens):
                return
            session = self._sessions[seq.session_id] = Session(seq.session_id, SessionState.RUNNING)
        if keep and seq.num_computed_tokens > 0:
            n = seq.num_computed_tokens
            kept = cdiv(n, self.pool.block_size)
            old = session.block_ids
            session.block_ids, seq.block_table = seq.block_table[:kept], seq.block_table[kept:]
            self._take_tokens(session, seq.tokens_slice(0, n), seq.block_hashes, seq.salt)
            for block_id, h in zip(session.block_ids, session.hashes, strict=True):
                self.pool.cache(block_id, h)
            session.saved = False
            session.last_used = time.time()
            self.pool.free(reversed(old))
            if self.shared is not None:
                blocks = dict(zip(session.hashes, session.block_ids, strict=True))
                self.shared.publish(
                    session.session_id, session.token_ids, blocks, session.last_used, session.salt
                )
        self._settle(session)

    def _settle(self, session: Session) -> None:
        """An idle session lands where its KV is: the pool, or the store below it."""
        if session.resident:
            self._move(session, SessionState.RESIDENT)
        elif session.token_ids:
            self._move(session, SessionState.SPILLED)
        else:  # nothing left to reuse
            self._forget(session)

    def copy_block(self, src: int, dst: int) -> None:
        self.store.codec.copy_block(src, dst)

    # -- memory pressure -----------------------------------------------------------------------
    def make_room(
        self, num_blocks: int, protect: Session | None = None, include_running: bool = False
    ) -> bool:
        """Spill sessions, idle ones least recently used first, until `num_blocks` are free.

        With `include_running`, running sessions follow: what they hold beyond their request's
        own references is better spilled than a running request preempted.
        """
        while self.pool.num_free < num_blocks:
            victim = self._lru(protect, running=False) or (
                self._lru(protect, running=True) if include_running else None
            )
            if victim is None:
                return False
            self.evict(victim)
        return True

    def _lru(self, protect: Session | None, running: bool) -> Session | None:
        candidates = [
            s
            for s in self._sessions.values()
            if s.resident and s.running == running and s is not protect
        ]
        return min(candidates, key=lambda s: s.last_used) if candidates else None

    def evict(self, session: Session) -> None:
        """Give a session's blocks back to the pool: they stay cached there, and are demoted
        to host memory when the pool reuses them."""
        self.pool.free(reversed(session.block_ids))
        session.block_ids = []
        if not session.running:
            self._settle(session)

    # -- control -------------------------------------------------------------------------------
    def flush(self) -> int:
        """Persist every session whose manifest is missing or stale: its blocks on disk, then
        its manifest; returns how many. Turns queued for the shared folder are written first,
        and every other cached block goes to disk too (a conversation resent whole, with no
        session, finds its prefix after a restart)."""
        if self.shared is not None:
            self.shared.drain()
        if not self.manifests.persistent:
            return 0
        self._forget_unpinned()
        self.store.write_back()
        saved = 0
        for session in list(self._sessions.values()):
            if session.saved or not session.token_ids:
                continue
            blocks = dict(zip(session.hashes, session.block_ids, strict=False))
            n = self.store.persist(session.hashes, blocks)
            if n < len(session.hashes):  # only a prefix is left anywhere: keep that
                session.token_ids = session.token_ids[: n * self.pool.block_size]
                session.hashes = session.hashes[:n]
            if session.token_ids and self.manifests.write(
                session.session_id, session.token_ids, session.last_used, session.salt
            ):
                session.saved = True
                self.stats.disk_writes += 1
                saved += 1
        return saved

    def drop(self, session_id: str) -> bool:
        """Forget a session's KV in memory, on disk and in the shared folder; a request of it
        keeps its own blocks."""
        session = self._sessions.get(session_id)
        if self.shared is not None:
            self.shared.delete(session_id)
        if session is None:
            self.manifests.delete(session_id)
            return False
        self._forget(session)
        self.pool.free(reversed(session.block_ids))
        session.block_ids = []
        return True

    def _forget(self, session: Session) -> None:
        del self._sessions[session.session_id]
        self.store.pins.unpin(PIN + session.session_id)
        self.manifests.delete(session.session_id)

    def _forget_unpinned(self) -> None:
        """Sessions whose pin the disk tier gave up for room are forgotten (when idle and out
        of the pool), or at least no longer saved."""
        for name in self.store.disk.take_unpinned():
            session = self._sessions.get(name.removeprefix(PIN)) if name.startswith(PIN) else None
            if session is None or self.store.pins.get(name) is not None:
                continue
            if session.state is SessionState.SPILLED:
                self._forget(session)
            else:
                session.saved = False
                self.manifests.delete(session.session_id)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
