"""`batchify(...)`: the scope inside which SDK calls travel as provider batch jobs.

The scope owns an event loop on a thread of its own where the batcher lives, so async
callers (on whatever loop) and sync callers (blocked on a future) are served alike. The active
scope is a ContextVar, so concurrent tasks can run different scopes; `process_wide=True`
also covers threads that do not inherit the context (thread pools; the CLI uses it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from contextvars import ContextVar, Token
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from shoal.batchify import transport
from shoal.batchify.adapters import to_call
from shoal.batchify.budget import QuotaPolicy
from shoal.batchify.cache import DEFAULT_MAX_AGE_S, Cache, default_cache_path
from shoal.batchify.calls import Call, Outcome, Pending, settle
from shoal.batchify.errors import BatchifyClosedError
from shoal.batchify.jobs import FaultHook
from shoal.batchify.progress import make_progress
from shoal.batchify.provider import ProviderHTTP
from shoal.batchify.queues import Batcher, Stats

log = logging.getLogger("shoal.batchify")
_ACTIVE: ContextVar[Batchify | None] = ContextVar("shoal_batchify", default=None)
_PROCESS_WIDE: list[Batchify] = []


def current_scope() -> Batchify | None:
    scope = _ACTIVE.get()
    if scope is None and _PROCESS_WIDE:
        scope = _PROCESS_WIDE[-1]
    return scope


class Batchify:
    """Use as `async with batchify(...) as b:` or `with batchify(...) as b:`.

    batch_size: a queue holding this many calls is submitted at once (the provider's own
    request and byte limits split it further). window_s: a queue is submitted this long after
    its first call. poll_interval_s / max_poll_interval_s: polls start at the first and slow
    down to the second. cache_path: the SQLite ledger (default ~/.cache/shoal/). dry_run: no
    provider I/O, no cache; every call gets an empty 200 marked `x-shoal-dry-run: 1`.
    cancel_on_abort: cancel running provider batches when the block exits by an exception.
    process_wide: also catch calls from threads that do not inherit the context.
    live_progress: a rich table (None: on a terminal only). fault_hook: called at
    "intent_written", "submitted" and "recorded" (crash tests). provider_transport: the
    httpx transport for the batcher's own calls (proxies, tests). quota: a `QuotaPolicy`;
    each batch then reserves its requests and tokens through `shoal.quota` before it is
    submitted (`budget.py`).
    """

    def __init__(
        self,
        *,
        batch_size: int = 1000,
        window_s: float = 2.0,
        poll_interval_s: float = 10.0,
        max_poll_interval_s: float = 300.0,
        cache_path: str | Path | None = None,
        cache_max_age_s: float = DEFAULT_MAX_AGE_S,
        dry_run: bool = False,
        cancel_on_abort: bool = False,
        process_wide: bool = False,
        live_progress: bool | None = None,
        fault_hook: FaultHook | None = None,
        provider_transport: httpx.AsyncBaseTransport | None = None,
        quota: QuotaPolicy | None = None,
    ) -> None:
        if batch_size < 1 or window_s < 0 or poll_interval_s <= 0:
            raise ValueError("batch_size >= 1, window_s >= 0 and poll_interval_s > 0 are needed")
        self.batch_size = batch_size
        self.window_s = window_s
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max_poll_interval_s
        self.dry_run = dry_run
        self.fault_hook = fault_hook
        self.provider_transport = provider_transport
        self.quota = quota
        self.cache_path = None if dry_run else Path(cache_path or default_cache_path())
        self.cache_max_age_s = cache_max_age_s
        self.cancel_on_abort = cancel_on_abort
        self.process_wide = process_wide
        self.live_progress = live_progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._batcher: Batcher | None = None
        self._http: ProviderHTTP | None = None
        self._cache: Cache | None = None
        self._token: Token[Batchify | None] | None = None
        self._closed = False
        self._entered = False
        self._inbox: list[Pending] = []
        self._inbox_lock = threading.Lock()

    # -- what the transport hook calls -----------------------------------------------------
    def intercept(self, request: Any) -> Call | None:
        return to_call(request)

    def submit(self, call: Call) -> Future[Outcome]:
        """For a sync caller, which blocks on the returned future."""
        fut: Future[Outcome] = Future()
        self._post(Pending(call, fut))
        return fut

    def submit_async(self, call: Call) -> asyncio.Future[Outcome]:
        """For an async caller: a future of its own loop, resolved from the batcher's."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        self._post(Pending(call, fut, loop))
        return fut

    def _post(self, p: Pending) -> None:
        """Hand a call to the batcher's thread, waking it once per burst of calls."""
        loop = self._loop
        if self._closed or loop is None:
            settle([(p, BatchifyClosedError("this batchify scope is closed"))])
            return
        with self._inbox_lock:
            self._inbox.append(p)
            wake = len(self._inbox) == 1
        if wake:
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._inbox_lock:
            pending, self._inbox = self._inbox, []
        assert self._batcher is not None
        for p in pending:
            self._batcher.add(p)

    # -- figures ---------------------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        return self._batcher.stats if self._batcher is not None else Stats()

    @property
    def provider_requests(self) -> int:
        """HTTP requests this scope sent to providers (uploads, creates, polls, results)."""
        return self._http.requests_sent if self._http is not None else 0

    # -- life cycle ------------------------------------------------------------------------
    def open(self) -> Batchify:
        self._start()
        self._activate()
        return self

    def _start(self) -> None:
        """Open the ledger (blocking I/O) and start the batcher's loop thread."""
        if self._loop is not None or self._closed:
            raise BatchifyClosedError("a batchify scope opens once")
        if self.cache_path is not None:
            self._cache = Cache(self.cache_path, self.cache_max_age_s)
        self._http = ProviderHTTP(transport=self.provider_transport)
        progress = make_progress(self.live_progress)
        loop = self._loop = asyncio.new_event_loop()
        self._batcher = Batcher(
            batch_size=self.batch_size,
            window_s=self.window_s,
            poll_interval_s=self.poll_interval_s,
            max_poll_interval_s=self.max_poll_interval_s,
            cache=self._cache,
            http=self._http,
            progress=progress,
            dry_run=self.dry_run,
            fault=self.fault_hook,
            quota=self.quota,
        )
        self._thread = threading.Thread(target=loop.run_forever, name="shoal-batchify", daemon=True)
        self._thread.start()

    def _activate(self) -> None:
        """In the caller's context: calls from here on are intercepted."""
        transport.install(current_scope)
        self._token = _ACTIVE.set(self)
        if self.process_wide:
            _PROCESS_WIDE.append(self)

    def _close_future(self, cancel: bool) -> Future[None]:
        assert self._loop is not None and self._batcher is not None
        return asyncio.run_coroutine_threadsafe(self._batcher.close(cancel), self._loop)

    def _deactivate(self) -> None:
        """In the caller's context: calls from here on go straight to the provider."""
        if self._token is None:
            return
        try:
            _ACTIVE.reset(self._token)
        except ValueError:  # closed from another context than the one that opened it
            _ACTIVE.set(None)
        self._token = None
        if self in _PROCESS_WIDE:
            _PROCESS_WIDE.remove(self)
        transport.uninstall()

    def _release(self) -> None:
        """After the batcher closed: stop the loop thread, close the client and the cache."""
        loop, http, batcher = self._loop, self._http, self._batcher
        assert loop is not None and http is not None and batcher is not None
        asyncio.run_coroutine_threadsafe(http.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join()
        loop.close()
        batcher.env.progress.close()
        if self._cache is not None:
            self._cache.close()

    def close(self, cancel: bool = False) -> None:
        """Submit what is queued, wait for every result, release everything. Idempotent.

        Inside a `with` block the scope stays current until the block ends, so calls made
        after `close()` raise BatchifyClosedError instead of silently going out at full price.
        """
        if self._closed or self._loop is None:
            self._closed = True
            return
        self._closed = True
        try:
            self._close_future(cancel).result()
        finally:
            if not self._entered:
                self._deactivate()
            self._release()

    async def aclose(self, cancel: bool = False) -> None:
        """`close()` without blocking the caller's event loop."""
        if self._closed or self._loop is None:
            self._closed = True
            return
        self._closed = True
        try:
            await asyncio.wrap_future(self._close_future(cancel))
        finally:
            if not self._entered:
                self._deactivate()
            await asyncio.to_thread(self._release)

    def __enter__(self) -> Batchify:
        self.open()
        self._entered = True
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close(cancel=self.cancel_on_abort and et is not None)
        finally:
            self._deactivate()

    async def __aenter__(self) -> Batchify:
        await asyncio.to_thread(self._start)  # the ledger opens off the caller's event loop
        self._activate()
        self._entered = True
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.aclose(cancel=self.cancel_on_abort and et is not None)
        finally:
            self._deactivate()


batchify = Batchify
