"""The engine's grammar compiles, off every request path and bounded: `CompilePool` runs
`workers` threads of its own (never the default executor), each owning one worker process
(`grammar_worker`), fed from a bounded queue. A job is compiled by a worker within the
budget (or refused), then its grammar is read back from the worker or, when that would cost
more, compiled again in the engine (`load` / `compile_here`).

The pool's threads run at nice +10 (Linux sets it per thread; threads they start inherit it),
as do the workers, so compiles cannot take the cores from request handling. Idle threads end
after `IDLE_S`, with their workers (a discarded engine's pool frees itself; a fork is cheap),
and `submit` starts them again. `close` fails every job not done, kills the workers and never
waits for a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from shoal.engine.grammar_worker import NICE, CompileRefusedError, GrammarBudget, Worker
from shoal.errors import EngineClosedError, QueueFullError

log = logging.getLogger(__name__)

IDLE_S = 30.0  # a thread idle this long ends, with its worker (`submit` starts them again)
LEAVE_S = 1.0  # how long `close` lets its threads end


class GrammarBusyError(QueueFullError):
    """Too many compiles are queued, or this one waited too long: retry later (a 429)."""


@dataclass(slots=True, eq=False)
class Job:
    kind: str
    text: str
    future: Future[Any]


def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Set a future once; a second setter (close racing a compile) is ignored."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _lower_priority() -> None:
    """This thread (and the threads it starts) yields the CPU to request handling; Linux sets
    nice values per thread. Elsewhere the thread keeps the process's priority."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


class CompilePool:
    """`submit(job)` queues a job; a pool thread has a worker compile it, then settles the
    job's future with the grammar (`load(serialized)` of the worker's, or `compile_here(kind,
    text)` in the engine), or with the reason it was refused. `on_done(seconds, refused)`
    counts."""

    def __init__(
        self,
        budget: GrammarBudget,
        tokenizer_info: Callable[[], str],
        load: Callable[[str], Any],
        compile_here: Callable[[str, str], Any],
        on_done: Callable[[float, bool], None],
    ) -> None:
        self.budget = budget
        self._tokenizer_info = tokenizer_info
        self._load = load
        self._compile_here = compile_here
        self._on_done = on_done
        self._queue: queue.Queue[Job | None] = queue.Queue(budget.max_queued)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[Worker] = set()
        self._running: set[Job] = set()
        self.closed = False

    @property
    def running(self) -> int:
        """Jobs compiling (in a worker, or then here)."""
        return len(self._running)

    @property
    def pending(self) -> int:
        """Jobs queued or compiling."""
        return self._queue.qsize() + self.running

    def start(self) -> None:
        """Start the threads (and their workers) that are not running, in the background."""
        with self._lock:
            while not self.closed and len(self._threads) < self.budget.workers:
                t = threading.Thread(target=self._run, name="shoal-grammar", daemon=True)
                self._threads.append(t)
                t.start()

    def submit(self, job: Job) -> None:
        if self.closed:
            raise EngineClosedError("the engine is shutting down")
        self.start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise GrammarBusyError(
                f"{self.budget.max_queued} constraints are already waiting to compile; retry later"
            ) from None

    def close(self) -> None:
        """Fail every job not done and kill the workers; compiles are never waited for.
        The threads are given `LEAVE_S` to end (they do at once unless one is compiling in
        the engine): a thread still inside xgrammar while the interpreter exits can abort it
        ("terminate called without an active exception")."""
        with self._lock:
            self.closed = True
            workers, running = list(self._workers), list(self._running)
            threads = list(self._threads)
        closed = EngineClosedError("the engine is shutting down")
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                settle(job.future, error=closed)
        for job in running:
            settle(job.future, error=closed)
        for worker in workers:
            worker.kill()
        for _ in threads:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
        deadline = time.monotonic() + LEAVE_S
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- the pool's threads ----------------------------------------------------------------
    def _new_worker(self) -> Worker | None:
        worker = Worker(self._tokenizer_info())
        with self._lock:
            if self.closed:
                worker.kill()
                return None
            self._workers.add(worker)
        return worker

    def _drop(self, worker: Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.kill()

    def _run(self) -> None:
        _lower_priority()
        worker: Worker | None = None
        try:
            worker = self._new_worker()
        except Exception:
            log.exception("a grammar compile worker failed to start")
        while not self.closed:
            try:
                job = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # idle: end, unless a job came (`start` then saw us alive)
                    if self._queue.empty():
                        self._threads.remove(threading.current_thread())
                        break
                continue
            if job is None or not job.future.set_running_or_notify_cancel():
                continue
            with self._lock:
                if self.closed:  # `close` ran between the queue and here
                    settle(job.future, error=EngineClosedError("the engine is shutting down"))
                    continue
                self._running.add(job)  # from now on `close` fails it
            start = time.perf_counter()
            try:
                worker = worker or self._new_worker()
                if worker is None:
                    raise EngineClosedError("the engine is shutting down")
                seconds = worker.compile(job.kind, job.text, self.budget)
                # serializing usually takes a few percent of the compile; as long, it is not
                serialized = worker.fetch(max(1.0, seconds), self.budget)
                if serialized is not None:
                    compiled = self._load(serialized)
                else:
                    compiled = self._compile_here(job.kind, job.text)
                self._on_done(time.perf_counter() - start, False)
                settle(job.future, compiled)
            except CompileRefusedError as e:
                self._on_done(time.perf_counter() - start, True)
                settle(job.future, error=e)
            except Exception as e:
                settle(job.future, error=e)
            finally:
                with self._lock:
                    self._running.discard(job)
            if worker is not None and not worker.alive:
                self._drop(worker)
                worker = None
        if worker is not None:
            self._drop(worker)
