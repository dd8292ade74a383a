"""Agent sessions: KV that outlives a request (pure Python, no torch).

A session keeps the token ids of its last turn and the pool blocks holding their KV, with one
reference on each block, so idle session KV is not churned by the prefix cache (SGLang's
`lock_ref`). `SessionManager` is the only writer of session state; a session is always in one
of three states:

    RUNNING   one of its requests is in the running batch: the session is *pinned*
    RESIDENT  idle, its KV in the pool: evictable, least recently used first
    SPILLED   idle, its KV only in the disk tier (or the shared tier): restored when a turn
              reuses it

    (new) ──start──▶ RUNNING ──finish──▶ RESIDENT ──evict──▶ SPILLED
                        ▲    ╰─finish (KV only on disk)─────────▶ │
                        ╰────────────── start ◀───────────────────┤ (RESIDENT too)
    disk scan at start-up ──▶ SPILLED;  drop / a failed spill ──▶ (gone)

(A *block* is referenced, a *session* is running or pinned: the words are not mixed.) A
running session's request holds its own reference on every block it uses, so what the session
holds beyond those can still be spilled (`make_room(..., include_running=True)`) when the only
alternative is preempting a running request. Bytes move through `SessionIO` (the torch side is
`kv_store`); this module decides what moves and when.

With a shared `SessionTier` (`session_tier.py`), every finished turn is also written behind to
a folder other engines share, and an idle session is looked up there: a copy that covers more
of the new prompt than this engine's (in the pool or on its disk) is adopted (SPILLED) and
restored from the tier.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.sequence import Sequence
from shoal.engine.session_io import SessionIO

if TYPE_CHECKING:
    from shoal.engine.session_tier import SessionTier


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
    block_ids: list[int] = field(default_factory=list)  # in-pool KV; empty when not resident
    last_used: float = field(default_factory=time.time)  # wall clock: it is persisted
    saved: bool = False  # the disk tier holds exactly `token_ids`
    tier_copy: Any = None  # the shared tier's manifest of `token_ids`, when restored from there

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
    disk_reads: int = 0
    disk_writes: int = 0
    restore_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))

    def restore_percentile(self, q: float) -> float:
        """The q-quantile of recent disk restores, in seconds (nearest rank)."""
        if not self.restore_latencies:
            return 0.0
        values = sorted(self.restore_latencies)
        return values[min(len(values) - 1, int(q * len(values)))]


class SessionManager:
    def __init__(
        self, pool: BlockPool, io: SessionIO, disk_cap_bytes: int, tier: SessionTier | None = None
    ) -> None:
        self.pool = pool
        self.io = io
        self.disk_cap_bytes = disk_cap_bytes
        self.tier = tier
        self.stats = SessionStats()
        self._sessions: dict[str, Session] = {}
        for s in io.stored():
            self._sessions[s.session_id] = Session(
                s.session_id, SessionState.SPILLED, list(s.token_ids), [], s.last_used, True
            )
        self._enforce_disk_cap()

    # -- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def find(self, session_id: str, prompt: list[int]) -> Session | None:
        """The session whose KV a turn with `prompt` should reuse: the one held here, unless it
        is idle and the shared tier holds a copy covering more of `prompt` (another engine
        served the later turns, or this one died before saving): that copy is adopted, even over
        an older copy in this pool. Reading a token's KV from the tier costs far less than
        recomputing it (SmolLM2 in float32: 46 KB against ~0.27 GFLOP)."""
        session = self._sessions.get(session_id)
        if self.tier is None or (session is not None and session.running):
            return session
        copy = self.tier.peek(session_id)
        if copy is None or (
            session is not None
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
        session.token_ids, session.saved, session.tier_copy = list(copy.token_ids), False, copy
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
            on_disk=self.io.has(session.session_id),
            saved=session.saved,
            running=session.running,
            last_used=session.last_used,
        )

    def _move(self, session: Session, to: SessionState) -> None:
        assert (session.state, to) in _LEGAL, f"session {session.state} -> {to}"
        session.state = to

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
        request's computed KV (the blocks move from `seq.block_table`); otherwise (an abort) it
        keeps what it had."""
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
            session.token_ids = seq.tokens_slice(0, n)
            session.saved, session.tier_copy = False, None
            session.last_used = time.time()
            self.pool.free(reversed(old))
            if self.tier is not None:
                self.tier.publish(
                    session.session_id, session.token_ids, session.block_ids, session.last_used
                )
        self._settle(session)

    def _settle(self, session: Session) -> None:
        """An idle session lands where its KV is: the pool, the disk, or nowhere."""
        if session.resident:
            self._move(session, SessionState.RESIDENT)
        elif session.saved:
            self._move(session, SessionState.SPILLED)
        else:  # nothing left to reuse (a stale disk copy of an older turn goes too)
            del self._sessions[session.session_id]
            self.io.delete(session.session_id)

    def restore(self, session: Session) -> bool:
        """Bring a spilled session's disk copy back into the pool; False if no room or unusable."""
        assert session.state is SessionState.SPILLED
        num_blocks = cdiv(len(session.token_ids), self.pool.block_size)
        if not self.make_room(num_blocks, protect=session):
            return False
        start = time.perf_counter()
        if session.tier_copy is not None:
            assert self.tier is not None
            data = self.tier.load(session.tier_copy)
        else:
            data = self.io.load(session.session_id, session.token_ids)
        if data is None:  # corrupt or mismatched: discarded (with a warning), so recompute
            del self._sessions[session.session_id]
            return False
        self.stats.disk_reads += 1
        session.block_ids = self.pool.allocate(num_blocks)
        session.tier_copy = None
        self.io.restore(data, session.block_ids)
        self._move(session, SessionState.RESIDENT)
        self.stats.restore_latencies.append(time.perf_counter() - start)
        return True

    def copy_block(self, src: int, dst: int) -> None:
        self.io.copy_block(src, dst)

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
        """Give a session's blocks back, spilling its KV to disk first unless already there."""
        if not session.saved:
            self._save(session)
        self.pool.free(reversed(session.block_ids))
        session.block_ids = []
        if session.running:
            if not session.saved:
                session.token_ids = []  # lost: the running turn refills it when it ends
        else:
            self._settle(session)

    def _save(self, session: Session) -> None:
        sid = session.session_id
        if self.io.save(sid, session.token_ids, session.block_ids, session.last_used):
            session.saved = True
            self.stats.disk_writes += 1
            self._enforce_disk_cap(keep=session)

    def _enforce_disk_cap(self, keep: Session | None = None) -> None:
        """Delete disk copies, least recently used first (`keep` last), until under the cap."""
        while self.io.disk_bytes > self.disk_cap_bytes:
            on_disk = [s for s in self._sessions.values() if self.io.has(s.session_id)]
            if not on_disk:
                return
            victim = min(on_disk, key=lambda s: (s is keep, s.last_used))
            self.io.delete(victim.session_id)
            victim.saved = False
            if victim.state is SessionState.SPILLED:
                del self._sessions[victim.session_id]

    # -- control -------------------------------------------------------------------------------
    def flush(self) -> int:
        """Save every resident session whose disk copy is missing or stale; returns how many.
        Turns queued for the shared tier are written first."""
        if self.tier is not None:
            self.tier.drain()
        if not self.io.persistent:
            return 0
        saved = 0
        for session in list(self._sessions.values()):
            if session.resident and not session.saved:
                self._save(session)
                saved += session.saved
        return saved

    def drop(self, session_id: str) -> bool:
        """Forget a session's KV in memory, on disk and in the shared tier; a request of it
        keeps its own blocks."""
        session = self._sessions.pop(session_id, None)
        self.io.delete(session_id)
        if self.tier is not None:
            self.tier.delete(session_id)
        if session is None:
            return False
        self.pool.free(reversed(session.block_ids))
        session.block_ids = []
        return True


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
