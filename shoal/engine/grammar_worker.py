"""One grammar compile worker: a process that compiles a spec within a time and memory budget
and can be killed, and the engine's handle on it.

Why a process: xgrammar cannot be interrupted inside a compile, and a 40-character schema
(`{"type": "string", "minLength": 4000}`) takes minutes, a large enum gigabytes, so a compile
must happen where it can be stopped. Its `timeout_s` of wall time over, the worker is killed
(and replaced: a fork is cheap); its address space may grow by `memory_bytes` (RLIMIT_AS,
Linux), past which xgrammar's allocation fails. Either way the constraint is refused.

How the grammar comes back: serialized to JSON, when that is cheap. It usually is (a few
percent of the compile time, read back without holding the GIL), but not always: a schema of
1,000 string properties is 2.4 MB compiled and 227 MB serialized, 31 s to write and 13 s to
read. So the worker writes it only when asked, within a deadline (as long as the compile took,
a second at least) and `transfer_bytes`; past either, the engine compiles the spec itself,
which takes what the worker just measured.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from shoal.engine.grammar_zygote import zygote
from shoal.errors import InvalidRequestError, ShoalError

MiB = 1 << 20
NICE = 10  # compiles yield the CPU to request handling
_START_TIMEOUT_S = 60.0  # a worker reads the vocabulary (the fork server imported the rest)


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """What compiling one grammar may cost (`EngineConfig.grammar_*`)."""

    workers: int = 2
    timeout_s: float = 20.0  # wall time of one compile in a worker
    memory_bytes: int = 1024 * MiB  # address space one compile may add
    wait_s: float = 60.0  # how long a request waits for its grammar, queue included
    max_queued: int = 64  # compiles waiting for a worker
    transfer_bytes: int = 32 * MiB  # a serialized grammar past this is compiled again instead

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_queued < 1:
            raise InvalidRequestError("grammar workers and max_queued must be >= 1")
        if self.timeout_s <= 0 or self.wait_s <= 0 or self.memory_bytes <= 0:
            raise InvalidRequestError("grammar compile budgets must be positive")


class CompileRefusedError(InvalidRequestError):
    """The spec costs more than the budget allows (time or memory): a 400."""


# -- the worker process -------------------------------------------------------------------
def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _address_space(extra: int) -> Iterator[None]:
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
    answer ("compile", kind, text, memory_bytes) with ("ok",), ("invalid", message) or
    ("memory",), and ("send", max_bytes, memory_bytes) with the grammar it just compiled as
    JSON: ("grammar", text), or ("none",) past either bound. Ends when the connection closes."""
    import xgrammar as xgr

    from shoal.engine.grammar_specs import admits_output, build, message

    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):
        return
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready",))
    compiled = None
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        reply: tuple[str, ...]
        with _address_space(request[-1]):
            if request[0] == "send":
                reply = ("none",)
                with contextlib.suppress(Exception):  # out of memory too: compiled again
                    if compiled is not None:
                        text = str(compiled.serialize_json())
                        if len(text) <= request[1]:
                            reply = ("grammar", text)
                compiled = None
            else:
                compiled = None
                try:
                    compiled = build(compiler, request[1], request[2])
                    reply = ("ok",)
                    if not admits_output(compiled):
                        reply = ("invalid", "it matches nothing: no output can satisfy it")
                except Exception as e:
                    reply = ("memory",) if _out_of_memory(e) else ("invalid", message(e)[:2000])
        conn.send(reply)


# -- the engine's handle ------------------------------------------------------------------
class Worker:
    """One worker process (forked by the fork server) and the connection to it."""

    def __init__(self, tokenizer_info: str) -> None:
        self._zygote = zygote()
        self.pid, self.conn = self._zygote.fork()
        self.alive = True
        self._kill_lock = threading.Lock()
        self.conn.send(tokenizer_info)
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise ShoalError("a grammar compile worker did not start")
        self.conn.recv()

    def compile(self, kind: str, text: str, budget: GrammarBudget) -> float:
        """Have the worker compile the spec: the seconds it took. Raises when it could not
        (killing the worker when it ran out of time or died)."""
        start = time.perf_counter()
        self.conn.send(("compile", kind, text, budget.memory_bytes))
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
        return time.perf_counter() - start

    def fetch(self, deadline_s: float, budget: GrammarBudget) -> str | None:
        """The grammar just compiled, serialized, if the worker writes it within the deadline
        and size; else None (and a worker that overran is killed)."""
        self.conn.send(("send", budget.transfer_bytes, budget.memory_bytes))
        if not self.conn.poll(deadline_s):
            self.kill()
            return None
        try:
            reply: tuple[Any, ...] = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            return None
        return str(reply[1]) if reply[0] == "grammar" else None

    def kill(self) -> None:
        """Safe to call again and from any thread: the engine's closing thread and the
        pool thread using the worker can both get here at once, and two closes of the
        connection would close its fd twice (EBADF, or a descriptor reused in between)."""
        with self._kill_lock:
            if self.alive:
                self.alive = False
                with contextlib.suppress(OSError):
                    self._zygote.kill(self.pid)
            if not self.conn.closed:
                self.conn.close()
