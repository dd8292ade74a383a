"""Grammar compiles within a budget: each new spec is first compiled by a worker process that
can be killed, and only a spec that compiled there in time and in memory is compiled again,
for use, in the engine's own process.

Why two compiles: xgrammar cannot be interrupted inside a compile, and a 40-character schema
(`{"type": "string", "minLength": 4000}`) can take minutes, or a large enum gigabytes, so the
first compile must happen where it can be stopped. Its result cannot come back instead: a
compiled grammar serializes to JSON up to a hundred times its size in memory (a schema of 1,000
string properties: 2.4 MB in memory, 227 MB and 31 s to serialize, 13 s to read back), so the
engine compiles the spec again, which takes what the worker just measured.

`CompilePool` runs `workers` threads (their own, never the default executor), each owning one
worker process forked by `grammar_zygote`. Jobs wait in a bounded queue. A worker gets
`timeout_s` of wall time, after which it is killed (and replaced) and the job refused; its
address space may grow by `memory_bytes` (RLIMIT_AS, Linux), past which xgrammar's allocation
fails and the job is refused. Workers and the pool's threads run at a lower CPU priority
(nice +10, per thread on Linux), so compiles cannot take the cores from request handling.
Idle threads end after `IDLE_S`, with their workers (a discarded engine's pool frees itself;
a fork is cheap), and `submit` starts them again. `close` fails every job not done, kills the
workers and never waits for a compile.
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
from multiprocessing.connection import Connection
from typing import Any

from shoal.engine.grammar_zygote import zygote
from shoal.errors import EngineClosedError, InvalidRequestError, QueueFullError, ShoalError

log = logging.getLogger(__name__)

MiB = 1 << 20
NICE = 10  # compiles yield the CPU to request handling
IDLE_S = 30.0  # a thread idle this long ends, with its worker (`submit` starts them again)
_START_TIMEOUT_S = 60.0  # a worker reads the vocabulary (the fork server imported the rest)


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """What compiling one grammar may cost (`EngineConfig.grammar_*`)."""

    workers: int = 2
    timeout_s: float = 20.0  # wall time of one compile in a worker
    memory_bytes: int = 1024 * MiB  # address space one compile may add
    wait_s: float = 60.0  # how long a request waits for its grammar, queue included
    max_queued: int = 64  # compiles waiting for a worker

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_queued < 1:
            raise InvalidRequestError("grammar workers and max_queued must be >= 1")
        if self.timeout_s <= 0 or self.wait_s <= 0 or self.memory_bytes <= 0:
            raise InvalidRequestError("grammar compile budgets must be positive")


class CompileRefusedError(InvalidRequestError):
    """The spec costs more than the budget allows (time or memory): a 400."""


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


# -- the worker process -------------------------------------------------------------------
def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _address_space(extra: int) -> Any:
    """Let the address space grow by at most `extra` bytes inside the block (Linux)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "bad_alloc" in str(e)


def serve(conn: Connection) -> None:
    """A worker process (forked by `grammar_zygote`): read the tokenizer's description, then
    compile each `(kind, text, memory_bytes)` it is sent and answer ("ok",),
    ("invalid", message) or ("memory",). Ends when the connection closes."""
    import xgrammar as xgr

    from shoal.engine.grammar_specs import admits_output, build, message

    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):
        return
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready",))
    while True:
        try:
            kind, text, memory_bytes = conn.recv()
        except (EOFError, OSError):
            return
        reply: tuple[str, ...]
        compiled = None
        with _address_space(memory_bytes):
            try:
                compiled = build(compiler, kind, text)
                if admits_output(compiled):
                    reply = ("ok",)
                else:
                    reply = ("invalid", "it matches nothing: no output can satisfy it")
            except Exception as e:
                reply = ("memory",) if _out_of_memory(e) else ("invalid", message(e)[:2000])
            del compiled
        conn.send(reply)


class _Worker:
    """One worker process (forked by the fork server) and the connection to it."""

    def __init__(self, tokenizer_info: str) -> None:
        self._zygote = zygote()
        self.pid, self.conn = self._zygote.fork()
        self.alive = True
        self.conn.send(tokenizer_info)
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise ShoalError("a grammar compile worker did not start")
        self.conn.recv()

    def compile(self, kind: str, text: str, budget: GrammarBudget) -> None:
        """Have the worker compile the spec; raises when it could not (killing the worker
        when it ran out of time or died)."""
        self.conn.send((kind, text, budget.memory_bytes))
        what = f"the {kind} constraint"
        if not self.conn.poll(budget.timeout_s):
            self.kill()
            raise CompileRefusedError(
                f"{what} takes longer than {budget.timeout_s:g} s to compile (the grammar "
                "compile timeout): simplify it (fewer optional properties, smaller length or "
                "repetition bounds)"
            )
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise CompileRefusedError(
                f"compiling {what} crashed (over the {budget.memory_bytes // MiB} MiB grammar "
                "compile memory budget, or nested too deeply)"
            ) from None
        if reply[0] == "memory":
            raise CompileRefusedError(
                f"compiling {what} needs more than {budget.memory_bytes // MiB} MiB (the "
                "grammar compile memory budget)"
            )
        if reply[0] == "invalid":
            raise InvalidRequestError(f"{what} does not compile: {reply[1]}")

    def kill(self) -> None:
        if self.alive:
            self.alive = False
            with contextlib.suppress(OSError):
                self._zygote.kill(self.pid)
        self.conn.close()


def _lower_priority() -> None:
    """This thread (and the threads it starts) yields the CPU to request handling; Linux sets
    nice values per thread. Elsewhere the thread keeps the process's priority."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


class CompilePool:
    """`submit(job)` queues a job; a pool thread has a worker try it, then calls
    `compile_here(kind, text)` (the engine's compile) and settles the job's future with its
    result, or with the reason it was refused. `on_done(seconds, refused)` counts."""

    def __init__(
        self,
        budget: GrammarBudget,
        tokenizer_info: Callable[[], str],
        compile_here: Callable[[str, str], Any],
        on_done: Callable[[float, bool], None],
    ) -> None:
        self.budget = budget
        self._tokenizer_info = tokenizer_info
        self._compile_here = compile_here
        self._on_done = on_done
        self._queue: queue.Queue[Job | None] = queue.Queue(budget.max_queued)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[_Worker] = set()
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
        """Fail every job not done and kill the workers; compiles are never waited for."""
        with self._lock:
            self.closed = True
            workers, running = list(self._workers), list(self._running)
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
        for _ in self._threads:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)

    # -- the pool's threads ----------------------------------------------------------------
    def _new_worker(self) -> _Worker | None:
        worker = _Worker(self._tokenizer_info())
        with self._lock:
            if self.closed:
                worker.kill()
                return None
            self._workers.add(worker)
        return worker

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.kill()

    def _run(self) -> None:
        _lower_priority()
        worker: _Worker | None = None
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
                self._running.add(job)
            start = time.perf_counter()
            try:
                worker = worker or self._new_worker()
                if worker is None:
                    raise EngineClosedError("the engine is shutting down")
                worker.compile(job.kind, job.text, self.budget)
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
