"""The client `Batcher`: when it flushes, what each batch holds, and how failures spread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from quota_helpers import complete, concurrency, rate, reserve, used

from shoal.quota import (
    Batcher,
    CompleteRequest,
    CompleteResult,
    QuotaClosedError,
    QuotaService,
    QuotaTransportError,
    ReserveRequest,
    ReserveResult,
)
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.testing import ManualClock
from shoal.quota.transport import LocalAsyncQuotaAPI


@pytest.fixture
def service(tmp_path: Path) -> Iterator[QuotaService]:
    service = QuotaService(SQLiteBackend(tmp_path / "q.db", clock=ManualClock()))
    service.put_limits([rate("rpm", 5), rate("tpm", 10**6), concurrency("jobs", 1)])
    yield service
    service.close()


class Recording(LocalAsyncQuotaAPI):
    """The real in-process service, noting each batch call as (kind, size, time)."""

    def __init__(self, service: QuotaService, fail: Exception | None = None) -> None:
        super().__init__(service)
        self.calls: list[tuple[str, int, float]] = []
        self.fail = fail

    async def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
        self.calls.append(("reserve", len(items), time.monotonic()))
        if self.fail:
            raise self.fail
        return await super().batch_reserve(items)

    async def batch_complete(self, items: Sequence[CompleteRequest]) -> list[CompleteResult]:
        self.calls.append(("complete", len(items), time.monotonic()))
        return await super().batch_complete(items)


async def test_a_full_batch_goes_at_once(service: QuotaService) -> None:
    api = Recording(service)
    batcher = Batcher(api, max_batch=4, flush_interval_s=10)
    started = time.monotonic()
    await asyncio.gather(*(batcher.reserve(reserve(("tpm", 1))) for _ in range(4)))
    assert time.monotonic() - started < 5  # not the 10 s interval
    assert [(k, n) for k, n, _ in api.calls] == [("reserve", 4)]


async def test_a_partial_batch_goes_after_the_interval(service: QuotaService) -> None:
    api = Recording(service)
    batcher = Batcher(api, max_batch=100, flush_interval_s=0.1)
    started = time.monotonic()
    await asyncio.gather(*(batcher.reserve(reserve(("tpm", 1))) for _ in range(3)))
    assert [(k, n) for k, n, _ in api.calls] == [("reserve", 3)]
    assert 0.09 < api.calls[0][2] - started < 0.5


async def test_many_items_are_split_at_max_batch(service: QuotaService) -> None:
    api = Recording(service)
    batcher = Batcher(api, max_batch=256, flush_interval_s=0.05)
    results = await asyncio.gather(*(batcher.reserve(reserve(("tpm", 1))) for _ in range(600)))
    assert all(r.allowed for r in results)
    assert sorted(n for _, n, _ in api.calls) == [88, 256, 256]
    assert used(service)["tpm"] == 600


async def test_each_caller_gets_its_own_result(service: QuotaService) -> None:
    batcher = Batcher(Recording(service), flush_interval_s=0.01)
    items = [reserve(("rpm", 1 + i % 3)) for i in range(12)]
    results = await asyncio.gather(*(batcher.reserve(i) for i in items))
    assert [r.allowed for r in results].count(True) >= 2
    # The service remembers each lease's decision: the batcher handed each caller that one.
    assert results == service.batch_reserve(items)


async def test_completes_are_sent_before_reserves(service: QuotaService) -> None:
    holder = reserve(("jobs", 1))
    assert service.reserve(holder).allowed
    api = Recording(service)
    batcher = Batcher(api, flush_interval_s=0.05)
    # Queued reserve first, complete second: the complete still goes first and frees the slot.
    got, done = await asyncio.gather(
        batcher.reserve(reserve(("jobs", 1))), batcher.complete(complete(holder.lease_id))
    )
    assert [k for k, _, _ in api.calls] == ["complete", "reserve"]
    assert done.ok and got.allowed


async def test_a_failed_batch_fails_every_item(service: QuotaService) -> None:
    batcher = Batcher(Recording(service, fail=QuotaTransportError("down")), flush_interval_s=0)
    results = await asyncio.gather(
        *(batcher.reserve(reserve(("tpm", 1))) for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, QuotaTransportError) for r in results)


async def test_a_wrong_number_of_results_fails_every_item(service: QuotaService) -> None:
    class Short(Recording):
        async def batch_reserve(self, items: Sequence[ReserveRequest]) -> list[ReserveResult]:
            return (await super().batch_reserve(items))[:-1]

    batcher = Batcher(Short(service), flush_interval_s=0)
    results = await asyncio.gather(
        *(batcher.reserve(reserve(("tpm", 1))) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, QuotaTransportError) for r in results)


async def test_close_flushes_then_refuses(service: QuotaService) -> None:
    api = Recording(service)
    waits: list[float] = []
    batcher = Batcher(api, flush_interval_s=60, on_queue_wait=waits.append)
    pending = [asyncio.ensure_future(batcher.reserve(reserve(("tpm", 1)))) for _ in range(3)]
    await asyncio.sleep(0)  # queued, and the interval is far away
    started = time.monotonic()
    await batcher.close()
    assert time.monotonic() - started < 30  # flushed at once, not after the 60 s interval
    assert all(p.result().allowed for p in pending)
    assert len(waits) == 3 and all(w >= 0 for w in waits)
    await batcher.close()  # twice is fine
    with pytest.raises(QuotaClosedError):
        await batcher.reserve(reserve(("tpm", 1)))
