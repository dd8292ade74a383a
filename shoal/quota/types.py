"""Plain data of the Reserve/Complete protocol (design input 004), shared by every layer.

Field names are the wire names, so the HTTP layer maps them one to one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ulid import ULID


def new_lease_id() -> str:
    """A fresh ULID; a denied lease stays denied, so every new attempt needs a new one."""
    return str(ULID())


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    amount: int


@dataclass(frozen=True, slots=True)
class Actual:
    key: str
    actual_amount: int


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """Take every requirement's amount together, or nothing."""

    lease_id: str
    requirements: Sequence[Requirement]
    job_id: str = ""


@dataclass(frozen=True, slots=True)
class CompleteRequest:
    """Report what a lease really used; rate keys not listed are charged as reserved."""

    lease_id: str
    actuals: Sequence[Actual] = field(default_factory=tuple)
    job_id: str = ""


@dataclass(frozen=True, slots=True)
class ReserveResult:
    allowed: bool
    retry_after_ms: int = 0
    reserved_at_unix_ms: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class CompleteResult:
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class Malformed:
    """An item that could not even be parsed; it answers `invalid_request` in its place."""

    reason: str


@dataclass(frozen=True, slots=True)
class Usage:
    """What a limit holds now (after expired holds are dropped); `used` may exceed
    `capacity` while debt from under-reserved completions is outstanding."""

    key: str
    kind: str
    capacity: int
    window_s: float
    used: int


def fingerprint(req: ReserveRequest) -> str:
    """What makes a replay the same request: the job and the requirements in any order."""
    parts = [req.job_id, *sorted(f"{r.key}\n{r.amount}" for r in req.requirements)]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()
