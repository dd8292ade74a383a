"""Where a request should go, decided without Ray: its `Route` (session, affinity key or a
pinned replica), the rendezvous order of the live replicas for a key, the ranking the request
router hands Ray Serve, and the per-replica session counts behind the hit rate.

Rendezvous (highest random weight) hashing: every replica scores `hash(key, replica)` and the
highest score is the key's home. A replica that leaves moves only its own keys (each to its
next-best replica) and one that joins takes only the keys it now wins, so the sessions of the
replicas that stay where they are never move.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shoal.server.ids import chain_of

SESSION_HEADER = "x-session-id"
BATCH_API = ("/v1/files", "/v1/batches", "/v1/messages/batches")
GENERATION_API = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
RESPONSES_API = "/v1/responses"
PREFIX_CHARS = 512  # of the prompt's text: enough to tell system prompts apart
BATCH_KEY = "shoal:batch-api"  # one home for the Files and Batch APIs (a replica's own store)


@dataclass(frozen=True, slots=True)
class Route:
    """What the request router needs to know of one request."""

    session_id: str | None = None  # a session's turn: its home replica holds the session's KV
    affinity: str | None = None  # no session: a key (prompt prefix, batch API) that prefers a home
    replica: str | None = None  # pinned to one replica (the metrics fan-out); nothing else

    @property
    def key(self) -> str | None:
        return self.session_id or self.affinity

    def within(self, tenant: str | None) -> Route:
        """The route in a tenant's namespace (`--keys`), as the replicas name its sessions:
        tenants' like-named sessions and like prompts are told apart."""
        if tenant is None:
            return self
        sid, key = self.session_id, self.affinity
        return replace(
            self,
            session_id=f"{tenant}/{sid}" if sid else None,
            affinity=f"{tenant}/{key}" if key and key != BATCH_KEY else key,
        )


def route_for(
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    shared_store: bool = False,
    tenant: str | None = None,
) -> Route:
    """The route of an HTTP request: its session id (the `X-Session-Id` header, or the body's
    `session_id`), else its prompt prefix, else nothing (load alone decides); in `tenant`'s
    namespace when given.

    The Files and Batch APIs go to one home while each replica keeps its own store; with a
    `shared_store` every replica answers them alike, so load decides.
    """
    return _route(method, path, headers, body, shared_store).within(tenant)


def _route(
    method: str, path: str, headers: Mapping[str, str], body: bytes, shared_store: bool
) -> Route:
    if path.startswith(BATCH_API):
        return Route() if shared_store else Route(affinity=BATCH_KEY)
    if path == RESPONSES_API or path.startswith(RESPONSES_API + "/"):
        return _response_route(path, body)
    session_id = headers.get(SESSION_HEADER) or None
    if method != "POST" or path not in GENERATION_API or session_id:
        return Route(session_id=session_id)
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return Route()
    if isinstance(data.get("session_id"), str) and data["session_id"]:
        return Route(session_id=data["session_id"])
    prefix = prompt_prefix(data)
    return Route(affinity=prefix) if prefix else Route()


def _response_route(path: str, body: bytes) -> Route:
    """A response chain is a session named by its first response's id, which every later id
    in the chain starts with: `/v1/responses/{id}...` goes to the chain's home, and so does a
    new response continuing it (`previous_response_id`). A new chain goes by its
    `prompt_cache_key`, else its prompt's prefix; the answer's `X-Session-Id` then names the
    chain, and the ingress records where it went."""
    rest = path.removeprefix(RESPONSES_API + "/").split("/")[0]
    if path != RESPONSES_API and rest != "input_tokens":
        return Route(session_id=chain_of(rest))
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return Route()
    previous = data.get("previous_response_id")
    chain = chain_of(previous) if isinstance(previous, str) else None
    if chain is not None:
        return Route(session_id=chain)
    key = data.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return Route(affinity=key)
    items = data.get("input")
    shaped = {"messages": items} if isinstance(items, list) else {"prompt": items or ""}
    prefix = prompt_prefix({"system": data.get("instructions") or "", **shaped})
    return Route(affinity=prefix) if prefix else Route()


def prompt_prefix(body: dict[str, Any]) -> str:
    """The first `PREFIX_CHARS` characters of a completion, chat or Messages request's text."""
    parts: list[str] = []
    for name in ("system", "prompt"):
        if name in body:
            parts.append(_text(body[name]))
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            parts.append(_text(message.get("content")))
    return "\n".join(parts)[:PREFIX_CHARS]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts, token ids, or a batch of prompts
        return " ".join(_text(p.get("text")) if isinstance(p, dict) else _text(p) for p in content)
    return "" if content is None else str(content)


def rendezvous(key: str, replicas: Iterable[str]) -> list[str]:
    """`replicas` in the key's order of preference: its home first."""

    def score(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)


def rank(
    route: Route,
    replicas: list[str],
    loads: Mapping[str, int],
    imbalance_threshold: int,
    home: str | None = None,
) -> list[list[str]]:
    """Ranks of replicas to try, most preferred first (Ray Serve takes the first rank with a
    replica whose queue is not full, the least loaded within it).

    A keyed request goes to its home (`home`, a session's; else the key's rendezvous first
    choice) unless the home's queue is longer than the shortest one by more than
    `imbalance_threshold` (then the least loaded take it and the home comes last); without a
    key, any replica, least loaded first. A pinned request goes to its replica only.
    """
    if route.replica is not None:
        return [[route.replica]] if route.replica in replicas else []
    if not replicas:
        return []
    if route.key is None:
        return [list(replicas)]
    order = rendezvous(route.key, replicas)
    if home in order:
        order.remove(home)
        order.insert(0, home)
    home, *others = order
    others.sort(key=lambda r: loads.get(r, 0))
    lightest = min(loads.get(r, 0) for r in replicas)
    if loads.get(home, 0) - lightest > imbalance_threshold:
        return [others, [home]] if others else [[home]]
    return [[home], others] if others else [[home]]


@dataclass
class SessionHomes:
    """Each session's home replica, as this ingress knows it (the `max_sessions` most recent;
    one forgotten is placed again, and the tier restores it wherever it lands)."""

    max_sessions: int = 100_000
    _home: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _count: dict[str, int] = field(default_factory=dict)  # known sessions per replica
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def home(self, session_id: str, replicas: list[str]) -> str | None:
        """Where the session lives if that replica is live; else where it goes now (recorded
        at once, so sessions placed together see each other): its rendezvous order's first
        replica holding fewer than ceil(mean) of the sessions known on live replicas."""
        if not replicas:
            return None
        with self._lock:
            home = self._home.get(session_id)
            if home in replicas:
                self._home.move_to_end(session_id)
                return home
            counts = [self._count.get(r, 0) for r in replicas]
            cap = math.ceil((sum(counts) + 1) / len(replicas))
            order = rendezvous(session_id, replicas)
            home = next(r for r in order if self._count.get(r, 0) < cap)
            self._set(session_id, home)
            return home

    def settle(self, session_id: str, replica: str) -> None:
        """The session's request was answered by `replica`: its KV lives there now."""
        with self._lock:
            self._set(session_id, replica)

    def _set(self, session_id: str, replica: str) -> None:
        old = self._home.pop(session_id, None)
        if old is not None:
            self._count[old] -= 1
        self._home[session_id] = replica
        self._count[replica] = self._count.get(replica, 0) + 1
        if len(self._home) > self.max_sessions:
            _, gone = self._home.popitem(last=False)
            self._count[gone] -= 1


@dataclass(slots=True)
class ReplicaCounts:
    hits: int = 0  # a session's request sent where its previous one went
    moved: int = 0  # sent elsewhere (its home was overloaded or gone)
    new: int = 0  # a session's first request seen by this router

    @property
    def hit_rate(self) -> float:
        seen = self.hits + self.moved
        return self.hits / seen if seen else 1.0


@dataclass
class RoutingStats:
    """Per-replica session placement, as the router saw it (one per process)."""

    max_sessions: int = 100_000
    replicas: list[str] = field(default_factory=list)  # live, as of the router's last update
    counts: dict[str, ReplicaCounts] = field(default_factory=dict)
    _last: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def routed(self, route: Route, replica: str) -> None:
        if route.session_id is None:
            return
        with self._lock:
            counts = self.counts.setdefault(replica, ReplicaCounts())
            previous = self._last.pop(route.session_id, None)
            if previous is None:
                counts.new += 1
            elif previous == replica:
                counts.hits += 1
            else:
                counts.moved += 1
            self._last[route.session_id] = replica
            if len(self._last) > self.max_sessions:
                self._last.popitem(last=False)

    def snapshot(self) -> dict[str, ReplicaCounts]:
        with self._lock:
            return {r: ReplicaCounts(c.hits, c.moved, c.new) for r, c in self.counts.items()}


STATS = RoutingStats()  # what this process's routers saw; the ingress exports it
HOMES = SessionHomes()  # where this process's routers send each session
