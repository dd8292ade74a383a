"""Reserve/Complete semantics every backend must share (each test runs on SQLite and Redis)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from quota_helpers import complete, concurrency, rate, reserve, used

from shoal.quota import (
    Actual,
    CompleteRequest,
    QuotaInvalidError,
    QuotaService,
    Requirement,
    ReserveRequest,
    ReserveResult,
    new_lease_id,
)
from shoal.quota.types import Malformed

Make = Callable[..., QuotaService]


@pytest.fixture
def svc(make_service: Make, backend_kind: str) -> QuotaService:
    return make_service(
        backend_kind,
        [
            rate("rpm", 3),
            rate("tpm", 1000),
            rate("big", 100),
            rate("one", 1),
            concurrency("jobs", 2),
        ],
    )


def test_batch_results_are_in_order_and_items_independent(svc: QuotaService) -> None:
    first = reserve(("rpm", 1))
    results = svc.batch_reserve(
        [
            first,
            reserve(("rpm", 1), lease_id="not-a-ulid"),
            reserve(("nope", 1)),
            reserve(("rpm", 5)),
            reserve(("rpm", 2)),
            reserve(("rpm", 1)),  # rpm is full now: denied, not an error
            Malformed("not an object"),
        ]
    )
    assert [(r.allowed, r.error) for r in results] == [
        (True, ""),
        (False, "invalid_request"),
        (False, "unknown_limit_key:nope"),
        (False, "exceeds_capacity:rpm"),
        (True, ""),
        (False, ""),
        (False, "invalid_request"),
    ]
    assert results[0].reserved_at_unix_ms > 0 and results[0].retry_after_ms == 0
    assert results[5].retry_after_ms > 0 and results[5].reserved_at_unix_ms == 0
    assert used(svc)["rpm"] == 3


def test_an_item_takes_all_its_requirements_or_none(svc: QuotaService) -> None:
    # Capacities 1 and 100, 2 of each: refused, and the 100 is untouched.
    r = svc.reserve(reserve(("big", 2), ("one", 2)))
    assert (r.allowed, r.error) == (False, "exceeds_capacity:one")
    assert used(svc)["big"] == 0
    # One requirement full: the others are not charged either.
    assert svc.reserve(reserve(("one", 1))).allowed
    r = svc.reserve(reserve(("big", 5), ("jobs", 1), ("one", 1)))
    assert not r.allowed and r.error == ""
    assert used(svc) | {"one": 0} == {"rpm": 0, "tpm": 0, "big": 0, "one": 0, "jobs": 0}


def test_a_replayed_lease_returns_its_first_decision_and_charges_once(svc: QuotaService) -> None:
    item = reserve(("rpm", 1), ("tpm", 300), job_id="job-1")
    first = svc.reserve(item)
    assert first.allowed
    # Retried alone, twice in one batch, in another requirement order, in lower case.
    lower = ReserveRequest(item.lease_id.lower(), tuple(reversed(item.requirements)), "job-1")
    again = [*svc.batch_reserve([item, item]), svc.reserve(lower)]
    assert again == [first, first, first]
    assert used(svc)["rpm"] == 1 and used(svc)["tpm"] == 300
    # The same lease id with other requirements or another job is a conflict.
    conflict = ReserveResult(False, error="lease_conflict")
    assert svc.reserve(reserve(("rpm", 2), lease_id=item.lease_id, job_id="job-1")) == conflict
    assert svc.reserve(reserve(("rpm", 1), ("tpm", 300), lease_id=item.lease_id)) == conflict
    assert used(svc)["rpm"] == 1


def test_a_denied_lease_stays_denied(svc: QuotaService) -> None:
    holders = [reserve(("jobs", 1)) for _ in range(2)]
    assert all(r.allowed for r in svc.batch_reserve(holders))
    late = reserve(("jobs", 1))
    denied = svc.reserve(late)
    assert not denied.allowed and 0 < denied.retry_after_ms <= 1000
    assert svc.complete(complete(holders[0].lease_id)).ok
    assert svc.reserve(late) == denied  # the same id keeps its answer...
    assert svc.reserve(reserve(("jobs", 1))).allowed  # ...a new one gets the freed slot


def test_complete_once_then_already_completed(svc: QuotaService) -> None:
    item = reserve(("jobs", 1), ("rpm", 1))
    assert svc.reserve(item).allowed
    assert used(svc)["jobs"] == 1
    results = svc.batch_complete([complete(item.lease_id), complete(item.lease_id)])
    assert [(r.ok, r.error) for r in results] == [(True, ""), (False, "already_completed")]
    assert used(svc)["jobs"] == 0 and used(svc)["rpm"] == 1  # released once; rpm stays charged
    assert svc.complete(complete(item.lease_id)).error == "already_completed"
    assert svc.complete(complete(new_lease_id())).error == "lease_not_found"
    # A replayed reserve after the Complete still answers the first decision, charging nothing.
    assert svc.reserve(item).allowed and used(svc)["jobs"] == 0


def test_completing_a_denied_lease_is_an_error(svc: QuotaService) -> None:
    assert svc.reserve(reserve(("one", 1))).allowed
    late = reserve(("one", 1))
    assert not svc.reserve(late).allowed
    assert svc.complete(complete(late.lease_id)).error == "lease_denied"


@pytest.mark.parametrize(
    "item",
    [
        ReserveRequest("01ARZ3NDEKTSV4RRFFQ69G5FA", (Requirement("rpm", 1),)),  # 25 characters
        ReserveRequest("01ARZ3NDEKTSV4RRFFQ69G5FAU", (Requirement("rpm", 1),)),  # U: not Crockford
        ReserveRequest(new_lease_id(), ()),
        ReserveRequest(new_lease_id(), tuple(Requirement(f"k{i}", 1) for i in range(33))),
        ReserveRequest(new_lease_id(), (Requirement("rpm", 0),)),
        ReserveRequest(new_lease_id(), (Requirement("rpm", -1),)),
        ReserveRequest(new_lease_id(), (Requirement("rpm", True),)),
        ReserveRequest(new_lease_id(), (Requirement("rpm", 1), Requirement("rpm", 1))),
        ReserveRequest(new_lease_id(), (Requirement("rpm", 1),), job_id="x" * 201),
        ReserveRequest(new_lease_id(), (Requirement("", 1),)),
    ],
)
def test_bad_reserve_items_answer_invalid_request_and_change_nothing(
    svc: QuotaService, item: ReserveRequest
) -> None:
    before = used(svc)
    good = reserve(("rpm", 1))
    results = svc.batch_reserve([item, good])
    assert results[0] == ReserveResult(False, error="invalid_request")
    assert results[1].allowed
    assert used(svc) == before | {"rpm": before["rpm"] + 1}


def test_an_unknown_key_changes_nothing_and_records_no_lease(svc: QuotaService) -> None:
    item = reserve(("rpm", 1), ("nope", 1))
    assert svc.reserve(item).error == "unknown_limit_key:nope"
    assert used(svc)["rpm"] == 0
    # The lease id was not spent: the same id with good requirements is a first attempt.
    assert svc.reserve(reserve(("rpm", 1), lease_id=item.lease_id)).allowed


@pytest.mark.parametrize("size", [0, 257])
def test_a_batch_of_0_or_257_items_is_refused_whole(svc: QuotaService, size: int) -> None:
    with pytest.raises(QuotaInvalidError, match=r"1\.\.256"):
        svc.batch_reserve([reserve(("rpm", 1)) for _ in range(size)])
    with pytest.raises(QuotaInvalidError, match=r"1\.\.256"):
        svc.batch_complete([complete(new_lease_id()) for _ in range(size)])
    assert used(svc)["rpm"] == 0


def test_a_batch_of_256_is_accepted(svc: QuotaService) -> None:
    results = svc.batch_reserve([reserve(("tpm", 1)) for _ in range(256)])
    assert all(r.allowed for r in results) and used(svc)["tpm"] == 256


@pytest.mark.parametrize(
    ("actuals", "error"),
    [
        ((Actual("tpm", -1),), "invalid_request"),
        ((Actual("tpm", 1), Actual("tpm", 2)), "invalid_request"),
        ((Actual("jobs", 1),), "invalid_request"),  # concurrency has no actual amount
        ((Actual("nope", 1),), "unknown_limit_key:nope"),
    ],
)
def test_bad_complete_items_change_nothing(
    svc: QuotaService, actuals: tuple[Actual, ...], error: str
) -> None:
    item = reserve(("tpm", 500), ("jobs", 1))
    assert svc.reserve(item).allowed
    bad = svc.complete(CompleteRequest(item.lease_id, actuals))
    assert (bad.ok, bad.error) == (False, error)
    assert used(svc)["tpm"] == 500 and used(svc)["jobs"] == 1
    assert svc.complete(complete(item.lease_id, ("tpm", 100))).ok  # still completable
    assert used(svc)["tpm"] == 100 and used(svc)["jobs"] == 0


def test_a_limit_cannot_change_kind(svc: QuotaService) -> None:
    with pytest.raises(QuotaInvalidError):
        svc.put_limits([rate("new", 5), concurrency("rpm", 3)])
    assert "new" not in used(svc)  # all or none


def test_a_lowered_capacity_blocks_new_reservations_until_usage_fits(svc: QuotaService) -> None:
    items = [reserve(("jobs", 1)) for _ in range(2)]
    assert all(r.allowed for r in svc.batch_reserve(items))
    svc.put_limits([concurrency("jobs", 1)])
    assert not svc.reserve(reserve(("jobs", 1))).allowed
    svc.complete(complete(items[0].lease_id))
    assert not svc.reserve(reserve(("jobs", 1))).allowed  # 1 used of 1
    svc.complete(complete(items[1].lease_id))
    assert svc.reserve(reserve(("jobs", 1))).allowed
