"""Design input 004's client batcher, for asyncio: many small calls, few batch requests.

Callers `await batcher.reserve(item)` as if alone. Items wait in one queue per kind until
`max_batch` of a kind are waiting or `flush_interval_s` has passed since the first one; then
everything queued goes out, Completes before Reserves (a Complete frees budget the Reserves
may need), while later items start filling the next batch. Each caller gets its own result.
If a batch request fails (transport error, or not one result per item), every item of it
fails with that error; a reserve may then be retried with the same lease id, since leases
are idempotent. `close()` sends what is queued and refuses anything after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shoal.quota.errors import QuotaClosedError, QuotaTransportError
from shoal.quota.transport import AsyncQuotaAPI
from shoal.quota.types import CompleteRequest, CompleteResult, ReserveRequest, ReserveResult

_Queued = tuple[Any, "asyncio.Future[Any]", float]  # item, its caller's future, when queued


class Batcher:
    def __init__(
        self,
        api: AsyncQuotaAPI,
        *,
        max_batch: int = 256,
        flush_interval_s: float = 0.002,
        on_queue_wait: Callable[[float], None] | None = None,
    ) -> None:
        """`on_queue_wait(seconds)` is told how long each item waited before it was sent
        (the latency batching adds)."""
        if max_batch < 1 or flush_interval_s < 0:
            raise ValueError("max_batch must be >= 1 and flush_interval_s >= 0")
        self.api = api
        self.max_batch = max_batch
        self.flush_interval_s = flush_interval_s
        self.on_queue_wait = on_queue_wait
        self._reserves: list[_Queued] = []
        self._completes: list[_Queued] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._closed = False

    async def reserve(self, item: ReserveRequest) -> ReserveResult:
        result: ReserveResult = await self._enqueue(self._reserves, item)
        return result

    async def complete(self, item: CompleteRequest) -> CompleteResult:
        result: CompleteResult = await self._enqueue(self._completes, item)
        return result

    def _enqueue(self, queue: list[_Queued], item: Any) -> asyncio.Future[Any]:
        if self._closed:
            raise QuotaClosedError("the batcher is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        queue.append((item, future, time.perf_counter()))
        if len(queue) >= self.max_batch:
            self._dispatch()
        elif self._timer is None:
            self._timer = loop.call_later(self.flush_interval_s, self._dispatch)
        return future

    def _dispatch(self) -> None:
        """Send everything queued, in the background."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        completes, self._completes = self._completes, []
        reserves, self._reserves = self._reserves, []
        if completes or reserves:
            task = asyncio.get_running_loop().create_task(self._send(completes, reserves))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, completes: list[_Queued], reserves: list[_Queued]) -> None:
        if completes:
            await self._deliver(completes, self.api.batch_complete)
        if reserves:
            await self._deliver(reserves, self.api.batch_reserve)

    async def _deliver(
        self, queued: list[_Queued], call: Callable[[Sequence[Any]], Awaitable[list[Any]]]
    ) -> None:
        sent = time.perf_counter()
        if self.on_queue_wait is not None:
            for _, _, at in queued:
                self.on_queue_wait(sent - at)
        try:
            results = await call([item for item, _, _ in queued])
            if len(results) != len(queued):
                raise QuotaTransportError(f"{len(results)} results for {len(queued)} items")
        except Exception as e:
            for _, future, _ in queued:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future, _), result in zip(queued, results, strict=True):
            if not future.done():  # the caller may have given up (cancelled)
                future.set_result(result)

    async def flush(self) -> None:
        """Send what is queued now and wait until every batch in flight has its answer."""
        self._dispatch()
        while self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    async def close(self) -> None:
        """Flush, then refuse new items; closing twice is harmless."""
        self._closed = True
        await self.flush()
