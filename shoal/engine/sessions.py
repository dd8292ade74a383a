"""Agent sessions: KV that outlives a request (pure Python, no torch).

A session keeps the token ids of its last turn and the pool blocks holding their KV, with one
reference on each block, so idle session KV is not churned by the prefix cache (SGLang's
`lock_ref`). A session is pinned while one of its requests is in the running batch (the
request holds its own reference on every block it uses, so eviction never touches those). Idle
sessions are evicted first, least recently used first, and spilled to the disk tier through
`SessionIO` rather than lost; what a pinned session holds beyond its request's blocks goes
only when the alternative is preempting a running request. The KV manager and the scheduler
only see this module and the `SessionIO` protocol; the torch side (copies, safetensors files)
lives in `kv_store`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the session holds
    block_ids: list[int] = field(default_factory=list)  # in-pool KV; empty when not resident
    last_used: float = field(default_factory=time.time)  # wall clock: it is persisted
    running: bool = False  # pinned: a request of this session is in the running batch
    on_disk: bool = False  # a file of this session exists in the disk tier
    saved: bool = False  # ... and it holds exactly `token_ids`

    @property
    def resident(self) -> bool:
        return bool(self.block_ids)


@dataclass(slots=True)
class SessionInfo:
    """What `llm.sessions` shows about one session."""

    session_id: str
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


class SessionIO(Protocol):
    """Moves KV bytes for the (torch-free) KV manager: block copies and the disk tier."""

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one pool block's KV into another (copy on write of a partial block)."""
        ...

    def save(self, session: Session) -> bool:
        """Write the session's resident KV to disk; False if it could not be written."""
        ...

    def load(self, session: Session) -> Any | None:
        """Read and validate the session's disk copy; None (after a warning) if unusable."""
        ...

    def restore(self, data: Any, block_ids: list[int]) -> None:
        """Write KV returned by `load` into freshly allocated pool blocks."""
        ...


class SessionTable:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.stats = SessionStats()

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def get_or_create(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id)
        return session

    def drop(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def lru(self, protect: Session | None = None, pinned: bool = False) -> Session | None:
        """The least recently used resident session: idle ones only, unless `pinned`."""
        candidates = [
            s
            for s in self.sessions.values()
            if s.resident and (pinned or not s.running) and s is not protect
        ]
        return min(candidates, key=lambda s: s.last_used) if candidates else None

    def info(self, session: Session) -> SessionInfo:
        return SessionInfo(
            session_id=session.session_id,
            num_tokens=len(session.token_ids),
            num_blocks=len(session.block_ids),
            in_memory=session.resident,
            on_disk=session.on_disk,
            saved=session.saved,
            running=session.running,
            last_used=session.last_used,
        )


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
