"""One provider batch, from the intent to every caller's result.

A job starts one of three ways: `submit` (fresh calls: intent, create, record, poll),
`resume` (the cache holds its batch id: poll), or `recover` (the cache holds the intent but no
id: the process died between create and record, so find the orphan by its tag and adopt it,
or, when no batch was created, hand the calls back to be submitted afresh). Custom ids are
derived from the intent's tag, so they are the same in every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shoal.batchify.adapters import Adapter, Results, Snapshot
from shoal.batchify.budget import BatchLease, BatchSpec, QuotaPolicy
from shoal.batchify.cache import Cache, Intent
from shoal.batchify.calls import Outcome, Pending, Target, settle
from shoal.batchify.errors import (
    BatchCancelledError,
    BatchFailedError,
    BatchResultMissingError,
    BatchSubmitError,
    ProviderHTTPError,
)
from shoal.batchify.poll import Backoff, Pacer, TransientHTTPError, with_retries
from shoal.batchify.progress import Progress
from shoal.batchify.provider import ProviderHTTP

log = logging.getLogger("shoal.batchify")
FaultHook = Callable[[str], None]


def custom_id(tag: str, index: int) -> str:
    """At most 64 characters of [A-Za-z0-9_-], as Anthropic requires."""
    return f"sb-{tag}-{index}"


@dataclass(slots=True)
class Env:
    """What every job shares: the provider client, the ledger, settings, and the batcher's
    way to take calls back (when a batch turns out not to exist)."""

    http: ProviderHTTP
    cache: Cache | None
    progress: Progress
    poll_interval_s: float
    max_poll_interval_s: float
    requeue: Callable[[list[Pending]], Awaitable[None]]
    fault: FaultHook | None = None
    quota: QuotaPolicy | None = None
    submit_attempts: int = 5

    def retry_backoff(self) -> Backoff:
        return Backoff(min(0.5, self.poll_interval_s), 30.0)


class Job:
    def __init__(self, env: Env, adapter: Adapter, target: Target, intent: Intent) -> None:
        self.env = env
        self.adapter = adapter
        self.target = target
        self.intent = intent
        self.waiting: dict[str, Pending] = {}
        self.results: Results | None = None
        self.failure: BaseException | None = None
        self.gone = False  # no such batch: its calls went back to the queues
        label = f"{adapter.name} {intent.endpoint}"
        env.progress.batch(intent.tag, label, intent.n)

    @property
    def tag(self) -> str:
        return self.intent.tag

    def attach(self, cid: str, p: Pending) -> bool:
        """Wait for `cid`'s result (or get it now); False if this batch is gone."""
        if self.gone:
            return False
        if self.results is not None:
            settle([(p, self.results.get(cid) or self._missing(cid))])
        elif self.failure is not None:
            settle([(p, self.failure)])
        else:
            self.waiting[cid] = p
        return True

    # -- entry points ----------------------------------------------------------------------
    async def submit(self, pending: list[Pending]) -> None:
        for i, p in enumerate(pending):
            self.waiting[custom_id(self.tag, i)] = p
        cache = self.env.cache
        lease = self._lease(pending)
        submitted = False
        try:
            if lease is not None:
                await lease.acquire()
            if cache is not None:
                rows = [(p.call.key, cid) for cid, p in self.waiting.items()]
                await asyncio.to_thread(cache.write_intent, self.intent, rows)
            self._fault("intent_written")
            items = [(cid, p.call.body) for cid, p in self.waiting.items()]
            batch_id, results = await self._create_uninterrupted(items)
            submitted = True
            self._fault("submitted")
            if cache is not None:
                await asyncio.to_thread(cache.record, self.tag, batch_id)
            self._fault("recorded")
            await self._finish(batch_id, results, first_delay=True)
        except BatchSubmitError as e:
            if cache is not None:  # nothing exists at the provider: a re-run submits again
                await asyncio.to_thread(cache.forget, self.tag)
            self._fail(e)
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            if lease is not None:
                done = None if self.results is None else self.results.values()
                await lease.release(done, submitted=submitted)

    async def resume(self) -> None:
        assert self.intent.batch_id is not None
        try:
            await self._finish(self.intent.batch_id, None, first_delay=False)
        except ProviderHTTPError as e:
            if e.status_code != 404:
                self._fail(e)
                return
            log.info("batch %s is gone; its requests are submitted again", self.intent.batch_id)
            await self._hand_back()
        except BaseException as e:
            self._fail(e)
            raise

    async def recover(self) -> None:
        try:
            found = await self._find_ours()
            if found is None:
                log.info("intent %s was never submitted; submitting its requests", self.tag)
                await self._hand_back()
                return
            batch_id, results = found
            log.info("adopted batch %s created before a crash", batch_id)
            if self.env.cache is not None:
                await asyncio.to_thread(self.env.cache.record, self.tag, batch_id)
            await self._finish(batch_id, results, first_delay=False)
        except BaseException as e:
            self._fail(e)
            raise

    async def cancel(self) -> None:
        """Cancel the provider batch (best effort); every waiting caller gets an error."""
        if self.intent.batch_id is not None and self.results is None:
            try:
                await self.adapter.cancel(self.env.http, self.target, self.intent.batch_id)
            except ProviderHTTPError as e:
                log.warning("could not cancel batch %s: %s", self.intent.batch_id, e)
        self._fail(BatchCancelledError(f"batch {self.intent.batch_id or self.tag} cancelled"))

    # -- steps -----------------------------------------------------------------------------
    def _lease(self, pending: list[Pending]) -> BatchLease | None:
        """The quota lease this batch must hold, if the scope has a quota policy."""
        if self.env.quota is None:
            return None
        first = pending[0].call
        spec = BatchSpec(
            self.adapter.name,
            self.target.base_url,
            self.target.endpoint,
            first.model,
            [p.call.body for p in pending],
        )
        return BatchLease(self.env.quota, spec, job_id=self.tag)

    async def _create_uninterrupted(
        self, items: list[tuple[str, dict]]
    ) -> tuple[str, Results | None]:
        """`_create`, finished even when this job is cancelled meanwhile (a scope closing with
        `cancel_on_abort`): the provider may already hold the batch, and only once its id is
        known can it be cancelled instead of left running, and paid for, at the provider."""
        create = asyncio.ensure_future(self._create(items))
        try:
            batch_id, results = await asyncio.shield(create)
        except asyncio.CancelledError:
            # If nothing was created, or it cannot be known, there is nothing to cancel.
            with contextlib.suppress(Exception):
                self.intent.batch_id = (await create)[0]
            raise
        self.intent.batch_id = batch_id
        return batch_id, results

    async def _create(self, items: list[tuple[str, dict]]) -> tuple[str, Results | None]:
        backoff = self.env.retry_backoff()
        last: Exception | None = None
        for _ in range(self.env.submit_attempts):
            try:
                return await self.adapter.submit(self.env.http, self.target, items, self.tag), None
            except TransientHTTPError as e:
                last = e  # the batch may exist even though no answer came back
                found = await self._find_ours()
                if found is not None:
                    return found
                await asyncio.sleep(backoff.next_delay(e.retry_after))
            except ProviderHTTPError as e:
                raise BatchSubmitError(f"the provider refused the batch: {e}") from e
        raise BatchSubmitError(f"could not submit the batch: {last}")

    async def _find_ours(self) -> tuple[str, Results | None] | None:
        """The provider batch created for this intent, if one was (with its results when
        they had to be read to prove it)."""
        http, n = self.env.http, self.intent.n
        candidates = await with_retries(
            lambda: self.adapter.find_orphans(
                http, self.target, self.tag, n, self.intent.created_at
            ),
            self.env.retry_backoff(),
            self.env.submit_attempts,
        )
        expected = {custom_id(self.tag, i) for i in range(n)}
        for c in candidates:
            if c.verified:
                return c.batch_id, None
            results = await self._results(await self._wait(c.batch_id, first_delay=False))
            if set(results) == expected:
                return c.batch_id, results
        return None

    async def _finish(self, batch_id: str, results: Results | None, *, first_delay: bool) -> None:
        self.intent.batch_id = batch_id
        self.env.progress.update(self.tag, state="submitted", batch_id=batch_id)
        if results is None:
            snap = await self._wait(batch_id, first_delay=first_delay)
            try:
                results = await self._results(snap)
            except BatchFailedError as e:
                self.env.progress.update(self.tag, state="failed", failed=self.intent.n)
                self._fail(e)
                return
        self.results = results
        replies = [(p, results.get(cid) or self._missing(cid)) for cid, p in self.waiting.items()]
        settle(replies)
        self.waiting.clear()
        failed = sum(not (isinstance(v, Outcome) and v.status_code < 400) for _, v in replies)
        state = "failed" if failed == self.intent.n else "done"
        self.env.progress.update(self.tag, state=state, done=self.intent.n, failed=failed)

    async def _wait(self, batch_id: str, *, first_delay: bool) -> Snapshot:
        backoff = Backoff(self.env.poll_interval_s, self.env.max_poll_interval_s)
        pacer = Pacer(backoff)
        if first_delay:
            await asyncio.sleep(backoff.next_delay())
        while True:
            try:
                snap = await self.adapter.poll(self.env.http, self.target, batch_id)
            except TransientHTTPError as e:
                await asyncio.sleep(backoff.next_delay(e.retry_after))
                continue
            state = "in progress" if not snap.terminal else snap.status
            self.env.progress.update(self.tag, state=state, done=snap.done, failed=snap.failed)
            if snap.terminal:
                return snap
            await asyncio.sleep(pacer.next_delay(snap.done, snap.total))

    async def _results(self, snap: Snapshot) -> Results:
        return await with_retries(
            lambda: self.adapter.results(self.env.http, self.target, snap),
            self.env.retry_backoff(),
            None,
        )

    async def _hand_back(self) -> None:
        self.gone = True
        if self.env.cache is not None:
            await asyncio.to_thread(self.env.cache.forget, self.tag)
        self.env.progress.update(self.tag, state="resubmitted")
        pending, self.waiting = list(self.waiting.values()), {}
        await self.env.requeue(pending)

    def _fail(self, error: BaseException) -> None:
        if not isinstance(error, Exception):  # cancelled or interrupted: say so to the callers
            error = BatchCancelledError(f"batch {self.tag} abandoned: {type(error).__name__}")
        self.failure = error
        settle((p, error) for p in self.waiting.values())
        self.waiting.clear()

    def _missing(self, cid: str) -> BatchResultMissingError:
        return BatchResultMissingError(
            f"batch {self.intent.batch_id} ended without a result for {cid}"
        )

    def _fault(self, point: str) -> None:
        if self.env.fault is not None:
            self.env.fault(point)
