"""What the transport hands the batcher (a `Call`) and what it gets back (an `Outcome`).

Neutral of the HTTP library: the SDKs send through `httpx` or `httpx2`, and each caller's
response is rebuilt with the library its own client uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any


def canonical_json(obj: Any) -> str:
    """Key order and whitespace do not change what a request means, so they do not count."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Target:
    """Where a batch goes and as whom: one provider account at one base URL, one endpoint."""

    adapter: str
    base_url: str  # e.g. "http://127.0.0.1:8000/v1"
    endpoint: str  # e.g. "/v1/chat/completions"
    headers: tuple[tuple[str, str], ...]  # the account headers, sent on every batch call

    @property
    def account(self) -> str:
        """A fingerprint of the credentials: queues keep accounts apart without holding keys."""
        return sha256_hex(canonical_json(sorted(self.headers)))[:16]


@dataclass(slots=True)
class Call:
    """One intercepted request that has a batch equivalent."""

    target: Target
    model: str
    body: dict[str, Any]
    line_bytes: int  # the size of its line in a batch file, for the provider's byte limit
    fingerprint: str  # adapter, base URL, endpoint and canonical body
    key: str = ""  # fingerprint + ordinal among identical calls of this scope (set on arrival)

    @property
    def queue_key(self) -> tuple[str, str, str, str, str]:
        t = self.target
        return (t.adapter, t.base_url, t.account, t.endpoint, self.model)


@dataclass(slots=True)
class Outcome:
    """A provider's answer to one request, before it becomes the caller's response object."""

    status_code: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def json_outcome(status_code: int, body: Any, headers: dict[str, str] | None = None) -> Outcome:
    data = json.dumps(body).encode()
    return Outcome(status_code, data, {"content-type": "application/json", **(headers or {})})


Reply = Outcome | BaseException


@dataclass(slots=True)
class Pending:
    """A call and where its caller waits: a concurrent future (a sync caller, blocked on it)
    or an asyncio future on the caller's own event loop (`loop` set)."""

    call: Call
    future: Future[Outcome] | asyncio.Future[Outcome]
    loop: asyncio.AbstractEventLoop | None = None


def settle(replies: Iterable[tuple[Pending, Reply]]) -> None:
    """Resolve callers' futures from the batcher's thread. Callers on one event loop are
    woken once for all of them, not once each: a batch of 1,000 is one wake-up, not 1,000."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Reply]]] = {}
    for p, value in replies:
        if p.loop is None:
            _resolve([(p.future, value)])
        else:
            by_loop.setdefault(p.loop, []).append((p.future, value))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there any more
            loop.call_soon_threadsafe(_resolve, items)


def _resolve(items: list[tuple[Any, Reply]]) -> None:
    for fut, value in items:
        if fut.done():  # its caller gave up (cancelled)
            continue
        try:
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        except InvalidStateError:  # a concurrent future cancelled in the meantime
            pass
