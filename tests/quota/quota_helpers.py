"""Small builders shared by the quota tests."""

from __future__ import annotations

from shoal.quota import (
    Actual,
    CompleteRequest,
    Limit,
    LimitKind,
    QuotaService,
    Requirement,
    ReserveRequest,
    new_lease_id,
)


def rate(key: str, capacity: int, window_s: float = 60) -> Limit:
    return Limit(key, LimitKind.RATE, capacity, window_s)


def concurrency(key: str, capacity: int, timeout_s: float = 300) -> Limit:
    return Limit(key, LimitKind.CONCURRENCY, capacity, timeout_s)


def reserve(
    *reqs: tuple[str, int], lease_id: str | None = None, job_id: str = ""
) -> ReserveRequest:
    """`reserve(("rpm", 1), ("tpm", 500))` under a fresh lease id unless one is given."""
    return ReserveRequest(
        lease_id or new_lease_id(), tuple(Requirement(k, a) for k, a in reqs), job_id
    )


def complete(lease_id: str, *actuals: tuple[str, int]) -> CompleteRequest:
    return CompleteRequest(lease_id, tuple(Actual(k, a) for k, a in actuals))


def used(service: QuotaService) -> dict[str, int]:
    return {u.key: u.used for u in service.usage()}
