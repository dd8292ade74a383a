"""The quota service: the rules every backend relies on, and results kept in request order.

A batch of 1..`max_batch` items is checked as a whole (otherwise `QuotaInvalidError` and
nothing changes); each item is then checked on its own, so a bad item answers
`invalid_request` in its place while its neighbours go to the backend. There is no atomicity
across items: each is decided as if it came alone, in order.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.quota.backend import QuotaBackend, open_backend
from shoal.quota.clock import Clock
from shoal.quota.errors import ItemError, QuotaBackendError, QuotaInvalidError
from shoal.quota.limits import KEY_PATTERN, MAX_AMOUNT, Limit, LimitKind, QuotaConfig, parse_limit
from shoal.quota.types import (
    Actual,
    CompleteRequest,
    CompleteResult,
    Malformed,
    Requirement,
    ReserveRequest,
    ReserveResult,
    Usage,
)

if TYPE_CHECKING:
    from shoal.quota.metrics import QuotaMetrics

log = logging.getLogger("shoal.quota")

MAX_REQUIREMENTS = 32
MAX_JOB_ID = 200
Req = TypeVar("Req")
Res = TypeVar("Res")


# A ULID as text: 26 Crockford base-32 digits, the first at most 7 (128 bits). A plain match
# rather than a parse: it runs for every item, and the canonical form is just upper case.
_ULID = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}", re.IGNORECASE)


def _lease_id(value: object) -> str | None:
    """The canonical (upper-case) form of a ULID, or None."""
    if not isinstance(value, str) or not _ULID.fullmatch(value):
        return None
    return value.upper()


def _amount(value: object, minimum: int) -> bool:
    return type(value) is int and minimum <= value <= MAX_AMOUNT


def _job_id(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_JOB_ID


def _keys_ok(keys: list[object], min_count: int) -> bool:
    return (
        min_count <= len(keys) <= MAX_REQUIREMENTS
        and all(isinstance(k, str) and KEY_PATTERN.fullmatch(k) for k in keys)
        and len(set(keys)) == len(keys)
    )


def check_reserve(item: ReserveRequest | Malformed) -> ReserveRequest | None:
    """`item` with its lease id made canonical, or None when it breaks a rule."""
    if not isinstance(item, ReserveRequest):
        return None
    lease_id = _lease_id(item.lease_id)
    reqs = list(item.requirements) if isinstance(item.requirements, list | tuple) else []
    if (
        lease_id is None
        or not _job_id(item.job_id)
        or not all(isinstance(r, Requirement) and _amount(r.amount, 1) for r in reqs)
        or not _keys_ok([r.key for r in reqs], 1)
    ):
        return None
    return ReserveRequest(lease_id, tuple(reqs), item.job_id)


def check_complete(item: CompleteRequest | Malformed) -> CompleteRequest | None:
    if not isinstance(item, CompleteRequest):
        return None
    lease_id = _lease_id(item.lease_id)
    actuals = list(item.actuals) if isinstance(item.actuals, list | tuple) else None
    if (
        lease_id is None
        or actuals is None
        or not _job_id(item.job_id)
        or not all(isinstance(a, Actual) and _amount(a.actual_amount, 0) for a in actuals)
        or not _keys_ok([a.key for a in actuals], 0)
    ):
        return None
    return CompleteRequest(lease_id, tuple(actuals), item.job_id)


class QuotaService:
    """Reserve/Complete over one backend; thread-safe as far as the backend is."""

    def __init__(self, backend: QuotaBackend, *, max_batch: int = 256) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self.metrics: QuotaMetrics | None = None  # counts every decision when set

    @classmethod
    def open(
        cls,
        config: QuotaConfig,
        *,
        backend_url: str | None = None,
        data_dir: str | Path = "./shoal-data",
        clock: Clock | None = None,
    ) -> QuotaService:
        """The backend named by `backend_url` (else the config's, else SQLite in `data_dir`)
        with the config's limits declared."""
        backend = open_backend(
            backend_url or config.backend, data_dir=data_dir, policy=config.policy, clock=clock
        )
        service = cls(backend, max_batch=config.max_batch)
        if config.limits:
            backend.put_limits(config.limits)
        return service

    def _batch(
        self,
        items: Sequence[Any],
        check: Callable[[Any], Req | None],
        apply: Callable[[Sequence[Req]], list[Res]],
        failed: Callable[[str], Res],
    ) -> list[Res]:
        if not 1 <= len(items) <= self.max_batch:
            raise QuotaInvalidError(f"a batch holds 1..{self.max_batch} items, got {len(items)}")
        checked = [check(item) for item in items]
        valid = [c for c in checked if c is not None]
        done: Iterable[Res] = ()
        if valid:
            try:
                done = apply(valid)
            except QuotaBackendError:
                log.exception("quota backend failed; %d items answer backend_error", len(valid))
                done = [failed(ItemError.BACKEND_ERROR)] * len(valid)
        answers = iter(done)
        invalid = failed(ItemError.INVALID_REQUEST)
        return [next(answers) if c is not None else invalid for c in checked]

    def batch_reserve(self, items: Sequence[ReserveRequest | Malformed]) -> list[ReserveResult]:
        results = self._batch(
            items, check_reserve, self.backend.reserve_many, lambda e: ReserveResult(False, error=e)
        )
        if self.metrics is not None:
            self.metrics.observe_reserves(results)
        return results

    def batch_complete(self, items: Sequence[CompleteRequest | Malformed]) -> list[CompleteResult]:
        results = self._batch(
            items, check_complete, self.backend.complete_many, lambda e: CompleteResult(False, e)
        )
        if self.metrics is not None:
            self.metrics.observe_completes(results)
        return results

    def reserve(self, item: ReserveRequest | Malformed) -> ReserveResult:
        return self.batch_reserve([item])[0]

    def complete(self, item: CompleteRequest | Malformed) -> CompleteResult:
        return self.batch_complete([item])[0]

    def limits(self) -> list[Limit]:
        return [Limit(u.key, LimitKind(u.kind), u.capacity, u.window_s) for u in self.usage()]

    def put_limits(self, limits: Sequence[Limit | dict[str, Any]]) -> list[Limit]:
        """Declare or change limits (all or none); returns every limit."""
        policy = self.backend.policy
        parsed = [
            parse_limit(lim.to_dict() if isinstance(lim, Limit) else lim, policy) for lim in limits
        ]
        if len({lim.key for lim in parsed}) != len(parsed):
            raise QuotaInvalidError("a limit key is given twice")
        self.backend.put_limits(parsed)
        return self.limits()

    def usage(self) -> list[Usage]:
        return self.backend.usage()

    def close(self) -> None:
        self.backend.close()
