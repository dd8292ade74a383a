"""The Batcher: per-key queues that become provider batches, and the jobs that run them.

It lives on the scope's own event-loop thread, so sync callers (blocked on a future) and async
callers on any loop reach it alike. Queues are keyed by (adapter, base URL, account
fingerprint, endpoint, model): two accounts never share a batch. A queue's window timer starts
with its first call; reaching `batch_size` (or the provider's request or byte limit) submits at
once. Cache look-ups of calls arriving together share one query in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from shoal.batchify.adapters import ADAPTERS
from shoal.batchify.budget import QuotaPolicy
from shoal.batchify.cache import Cache, Intent
from shoal.batchify.calls import Pending, json_outcome, settle
from shoal.batchify.errors import BatchifyClosedError
from shoal.batchify.jobs import Env, FaultHook, Job, custom_id
from shoal.batchify.progress import Progress
from shoal.batchify.provider import ProviderHTTP

log = logging.getLogger("shoal.batchify")
QueueKey = tuple[str, str, str, str, str]


@dataclass(slots=True)
class _Queue:
    items: list[Pending] = field(default_factory=list)
    bytes: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class Stats:
    calls: int = 0  # intercepted calls
    cache_hits: int = 0  # calls answered from a batch of an earlier run
    batches: int = 0  # batches this scope submitted


class Batcher:
    def __init__(
        self,
        *,
        batch_size: int,
        window_s: float,
        poll_interval_s: float,
        max_poll_interval_s: float,
        cache: Cache | None,
        http: ProviderHTTP,
        progress: Progress,
        dry_run: bool = False,
        fault: FaultHook | None = None,
        quota: QuotaPolicy | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.window_s = window_s
        self.dry_run = dry_run
        self.env = Env(
            http,
            cache,
            progress,
            poll_interval_s,
            max_poll_interval_s,
            requeue=self._enqueue,
            fault=fault,
            quota=quota,
        )
        self.stats = Stats()
        self.closed = False
        self._lock = asyncio.Lock()
        self._queues: dict[QueueKey, _Queue] = {}
        self._ordinals: dict[str, int] = {}
        self._lookups: list[Pending] = []
        self._jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def add(self, p: Pending) -> None:
        """Take one call (on the batcher's loop). Identical calls get distinct keys by their
        order of arrival, so n samples of one prompt keep n results across a resume."""
        call = p.call
        if self.closed:
            settle([(p, BatchifyClosedError("this batchify scope is closed"))])
            return
        ordinal = self._ordinals.get(call.fingerprint, 0)
        self._ordinals[call.fingerprint] = ordinal + 1
        call.key = f"{call.fingerprint}:{ordinal}"
        self.stats.calls += 1
        self._lookups.append(p)
        if len(self._lookups) == 1:
            self._spawn(self._lookup())

    async def close(self, cancel: bool = False) -> None:
        """Submit what is queued and wait for every result; with `cancel`, cancel the provider
        batches still running instead. Idempotent."""
        self.closed = True
        async with self._lock:
            for key in list(self._queues):
                self._flush(key)
        if cancel:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for job in self._jobs.values():
                await job.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- arrival ---------------------------------------------------------------------------
    async def _lookup(self) -> None:
        pending, self._lookups = self._lookups, []
        cache = self.env.cache
        if cache is None:
            await self._enqueue(pending)
            return
        found = await asyncio.to_thread(cache.lookup, [p.call.key for p in pending])
        misses: list[Pending] = []
        for p in pending:
            hit = found.get(p.call.key)
            if hit is None:
                misses.append(p)
                continue
            job = self._jobs.get(hit.intent.tag)
            if job is None:
                adapter = ADAPTERS[hit.intent.adapter]
                job = self._jobs[hit.intent.tag] = Job(self.env, adapter, p.call.target, hit.intent)
                self._spawn(job.resume() if hit.intent.batch_id else job.recover())
            if job.attach(hit.custom_id, p):
                self.stats.cache_hits += 1
            else:
                misses.append(p)
        await self._enqueue(misses)

    async def _enqueue(self, pending: list[Pending]) -> None:
        async with self._lock:
            for p in pending:
                key = p.call.queue_key
                adapter = ADAPTERS[key[0]]
                q = self._queues.get(key)
                if q is not None and q.bytes + p.call.line_bytes > adapter.max_bytes:
                    self._flush(key)
                q = self._queues.setdefault(key, _Queue())
                q.items.append(p)
                q.bytes += p.call.line_bytes
                self.env.progress.queued(1)
                if len(q.items) == 1 and not self.closed:
                    q.timer = asyncio.get_running_loop().call_later(
                        self.window_s, self._on_timer, key
                    )
                if self.closed or len(q.items) >= min(self.batch_size, adapter.max_requests):
                    self._flush(key)

    def _on_timer(self, key: QueueKey) -> None:
        async def flush() -> None:
            async with self._lock:
                if key in self._queues:
                    self._flush(key)

        self._spawn(flush())

    # -- submission ------------------------------------------------------------------------
    def _flush(self, key: QueueKey) -> None:
        """Turn a queue into one batch (the caller holds the lock)."""
        q = self._queues.pop(key)
        if q.timer is not None:
            q.timer.cancel()
        self.env.progress.queued(-len(q.items))
        first = q.items[0].call
        adapter = ADAPTERS[first.target.adapter]
        intent = Intent(
            tag=uuid.uuid4().hex,
            adapter=adapter.name,
            base_url=first.target.base_url,
            endpoint=first.target.endpoint,
            n=len(q.items),
            created_at=time.time(),
        )
        if self.dry_run:
            replies = []
            for i, p in enumerate(q.items):
                body = adapter.dry_run_body(intent.endpoint, p.call.body, custom_id(intent.tag, i))
                replies.append((p, json_outcome(200, body, {"x-shoal-dry-run": "1"})))
            settle(replies)
            log.info("dry run: %d %s requests would form one batch", intent.n, intent.endpoint)
            return
        self.stats.batches += 1
        job = self._jobs[intent.tag] = Job(self.env, adapter, first.target, intent)
        self._spawn(job.submit(q.items))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("batchify task failed", exc_info=t.exception())

        task.add_done_callback(done)
