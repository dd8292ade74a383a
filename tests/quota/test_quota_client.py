"""`QuotaClient` and `AsyncQuotaClient`, in process and over HTTP, and their `lease()`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import pytest
from quota_helpers import complete, concurrency, rate, reserve, serve, used

from shoal.quota import (
    AsyncQuotaClient,
    QuotaClient,
    QuotaExceededError,
    QuotaInvalidError,
    QuotaItemError,
    QuotaService,
    QuotaTransportError,
    Requirement,
    ReserveRequest,
    ReserveResult,
)
from shoal.quota.http import create_app
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.transport import LocalAsyncQuotaAPI

WINDOW_S = 0.3
EARLIEST_S = WINDOW_S - 0.002  # the service's clock counts whole milliseconds
LIMITS = [rate("rpm", 2, WINDOW_S), rate("tpm", 1000, 60), concurrency("jobs", 1, 60)]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[QuotaService]:
    """SQLite on the real clock: the lease tests really wait."""
    service = QuotaService(SQLiteBackend(tmp_path / "q.db"))
    service.put_limits(LIMITS)
    yield service
    service.close()


@pytest.fixture(params=["local", "http"])
def client(request: pytest.FixtureRequest, service: QuotaService) -> Iterator[QuotaClient]:
    if request.param == "local":
        yield QuotaClient(service)
        return
    with serve(create_app(service)) as url:
        yield QuotaClient.http(url)


@pytest.fixture(params=["local", "http"])
async def aclient(
    request: pytest.FixtureRequest, service: QuotaService
) -> AsyncIterator[AsyncQuotaClient]:
    if request.param == "local":
        yield AsyncQuotaClient.local(service)
        return
    with serve(create_app(service)) as url:
        async with AsyncQuotaClient.http(url) as client:
            yield client


def test_calls_and_batches(client: QuotaClient, service: QuotaService) -> None:
    first, second = reserve(("jobs", 1)), reserve(("jobs", 1))
    assert [r.allowed for r in client.batch_reserve([first, second])] == [True, False]
    assert client.reserve(first).allowed  # replay
    assert client.complete(complete(first.lease_id)).ok
    assert client.batch_complete([complete(first.lease_id)])[0].error == "already_completed"
    assert {lim.key for lim in client.limits()} == {"jobs", "rpm", "tpm"}
    assert client.put_limits([rate("extra", 3)])[0].key == "extra"
    assert {u.key: u.used for u in client.usage()}["jobs"] == 0
    with pytest.raises(QuotaInvalidError):
        client.batch_reserve([])


def test_lease_reports_actuals_and_completes(client: QuotaClient, service: QuotaService) -> None:
    with client.lease([Requirement("tpm", 800), Requirement("jobs", 1)], job_id="j") as lease:
        assert used(service)["jobs"] == 1 and lease.reserved_at_unix_ms > 0
        lease.report("tpm", 120)
    assert used(service) == {"jobs": 0, "rpm": 0, "tpm": 120}


def test_lease_waits_out_a_denial_with_a_new_lease_id(client: QuotaClient) -> None:
    started = time.monotonic()
    for _ in range(2):
        assert client.reserve(reserve(("rpm", 1))).allowed
    with client.lease([Requirement("rpm", 1)], max_wait_s=5) as lease:
        # The window (0.3 s) rolls from the first reserve at the earliest: the lease waited
        # for it (a lease that gave up would have raised at max_wait_s instead).
        assert time.monotonic() - started >= EARLIEST_S
    # A denied lease stays denied, so the granted one must be a later id.
    assert client.reserve(ReserveRequest(lease.lease_id, (Requirement("rpm", 1),))).allowed


def test_lease_gives_up_at_its_deadline(client: QuotaClient, service: QuotaService) -> None:
    with client.lease([Requirement("jobs", 1)]):
        started = time.monotonic()
        with (
            pytest.raises(QuotaExceededError) as e,
            client.lease([Requirement("jobs", 1)], max_wait_s=0.5),
        ):
            pass
        assert time.monotonic() - started < 10  # not held until the other lease ends
        assert e.value.retry_after_s > 0
    assert used(service)["jobs"] == 0


def test_lease_completes_when_the_body_raises(client: QuotaClient, service: QuotaService) -> None:
    with pytest.raises(RuntimeError, match="provider down"), client.lease([Requirement("jobs", 1)]):
        raise RuntimeError("provider down")
    assert used(service)["jobs"] == 0


def test_lease_refused_for_good_raises_the_item_error(client: QuotaClient) -> None:
    refused = [("nope", "unknown_limit_key:nope"), ("rpm", "exceeds_capacity:rpm")]
    for key, error in refused:
        with pytest.raises(QuotaItemError, match=error), client.lease([Requirement(key, 3)]):
            pass


class LostAnswers:
    """A transport whose first reserve is applied but whose answer is lost on the way back."""

    def __init__(self, service: QuotaService) -> None:
        self.service = service
        self.sent: list[str] = []

    def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        self.sent += [i.lease_id for i in items]
        results = self.service.batch_reserve(items)
        if len(self.sent) == 1:
            raise QuotaTransportError("connection reset")
        return results

    def __getattr__(self, name: str) -> Callable[..., object]:
        return getattr(self.service, name)  # type: ignore[no-any-return]


def test_lease_retries_a_lost_answer_with_the_same_lease(service: QuotaService) -> None:
    api = LostAnswers(service)
    client = QuotaClient(api)  # type: ignore[arg-type]
    with client.lease([Requirement("tpm", 100)]):
        assert used(service)["tpm"] == 100  # charged once
    assert len(api.sent) == 2 and api.sent[0] == api.sent[1]


async def test_async_client_lease_and_batching(
    aclient: AsyncQuotaClient, service: QuotaService
) -> None:
    async with aclient.lease([Requirement("tpm", 500), Requirement("jobs", 1)]) as lease:
        assert used(service)["jobs"] == 1
        lease.report("tpm", 50)
    assert used(service)["tpm"] == 50 and used(service)["jobs"] == 0
    results = await aclient.batch_reserve([reserve(("tpm", 10)) for _ in range(3)])
    assert all(r.allowed for r in results)
    assert (await aclient.complete(complete(reserve(("tpm", 1)).lease_id))).error == (
        "lease_not_found"
    )
    assert {u.key for u in await aclient.usage()} == {"jobs", "rpm", "tpm"}


async def test_async_lease_waits_and_gives_up(service: QuotaService) -> None:
    client = AsyncQuotaClient(LocalAsyncQuotaAPI(service), batching=False)
    async with client.lease([Requirement("jobs", 1)]):
        with pytest.raises(QuotaExceededError):
            async with client.lease([Requirement("jobs", 1)], max_wait_s=0.3):
                pass
    started = time.monotonic()
    for _ in range(2):
        assert (await client.reserve(reserve(("rpm", 1)))).allowed
    async with client.lease([Requirement("rpm", 1)], max_wait_s=5):
        assert time.monotonic() - started >= EARLIEST_S
