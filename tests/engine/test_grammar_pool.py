"""Grammar compiles within a budget: a compile over its time or memory budget is refused and its
worker replaced (and never compiled in the engine), a grammar comes back from its worker or,
too large to ship, is compiled again, the queue is bounded, and closing fails what waits
without waiting for any compile. The slow spec takes minutes on any CPU (3,000 optional
properties: about 4 minutes on a Zen 3 core), so a budget of a second refuses it whatever
the machine's speed."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from shoal.engine.grammar_pool import CompilePool, GrammarBusyError, Job
from shoal.engine.grammar_worker import CompileRefusedError, GrammarBudget
from shoal.errors import EngineClosedError

SLOW = json.dumps(
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
)
SMALL = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
BIG_ENUM = json.dumps({"enum": [f"value-{i:06d}-{'x' * 32}" for i in range(20000)]})


@pytest.fixture(scope="module")
def tokenizer_info(tiny_chat_model: Path) -> str:
    import xgrammar as xgr

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    info = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=320, stop_token_ids=[tok.eos_token_id]
    )
    return str(info.serialize_json())


Pools = Callable[..., tuple[CompilePool, list[str]]]


@pytest.fixture
def pools(tokenizer_info: str) -> Iterator[Pools]:
    """`pools(**budget)`: a pool and how each grammar reached the engine ("loaded" from its
    worker, or "compiled" again); the grammar a job gets is that word."""
    made: list[CompilePool] = []

    def make(**budget: Any) -> tuple[CompilePool, list[str]]:
        how: list[str] = []

        def load(serialized: str) -> str:
            assert json.loads(serialized)  # a compiled grammar as JSON
            how.append("loaded")
            return "loaded"

        def compile_here(kind: str, text: str) -> str:
            how.append("compiled")
            return "compiled"

        pool = CompilePool(
            GrammarBudget(**budget), lambda: tokenizer_info, load, compile_here, lambda *_: None
        )
        made.append(pool)
        return pool, how

    yield make
    for pool in made:
        pool.close()


def _submit(pool: CompilePool, text: str) -> Future[Any]:
    future: Future[Any] = Future()
    pool.submit(Job("json", text, future))
    return future


def _until(condition: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_over_its_time_budget_a_compile_is_refused_and_its_worker_replaced(pools: Pools) -> None:
    pool, how = pools(workers=1, timeout_s=1.0)
    with pytest.raises(CompileRefusedError, match="longer than 1 s to compile"):
        _submit(pool, SLOW).result(120)
    assert how == []  # never compiled where it could not be stopped
    assert _submit(pool, SMALL).result(120) == "loaded"  # a new worker took over
    assert how == ["loaded"]


def test_a_grammar_too_large_to_ship_is_compiled_again(pools: Pools) -> None:
    pool, how = pools(workers=1, transfer_bytes=100)
    assert _submit(pool, SMALL).result(120) == "compiled"
    assert how == ["compiled"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's")
def test_over_its_memory_budget_a_compile_is_refused(pools: Pools) -> None:
    pool, how = pools(workers=1, memory_bytes=32 << 20)
    with pytest.raises(CompileRefusedError, match="32 MiB"):
        _submit(pool, BIG_ENUM).result(120)
    assert _submit(pool, SMALL).result(120) == "loaded"
    assert how == ["loaded"]


def test_the_queue_is_bounded(pools: Pools) -> None:
    pool, _ = pools(workers=1, max_queued=1, timeout_s=600.0)
    running = _submit(pool, SLOW)
    _until(lambda: pool.running == 1)
    queued = _submit(pool, SLOW.replace('"p1"', '"q1"'))
    with pytest.raises(GrammarBusyError, match="1 constraints are already waiting"):
        _submit(pool, SMALL)
    assert not running.done() and not queued.done()


def test_close_fails_what_waits_and_never_waits_for_a_compile(pools: Pools) -> None:
    pool, _ = pools(workers=1, timeout_s=600.0)
    running = _submit(pool, SLOW)
    _until(lambda: pool.running == 1)
    queued = _submit(pool, SMALL)
    pool.close()  # the running compile has minutes to go
    for future in (running, queued):
        assert future.done() and isinstance(future.exception(), EngineClosedError)
    with pytest.raises(EngineClosedError):
        _submit(pool, SMALL)


def test_a_worker_killed_from_two_threads_at_once_closes_its_connection_once(
    tokenizer_info: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's closing thread and the pool thread holding the worker can both kill it at
    once; a second close of the connection would close its descriptor twice (EBADF on
    shutdown, or a descriptor reused in between). The first kill is held inside the close
    until the second has been started."""
    import threading

    from shoal.engine.grammar_worker import Worker

    worker = Worker(tokenizer_info)
    conn_type = type(worker.conn)
    closes: list[int] = []
    inside, second_started = threading.Event(), threading.Event()
    original = conn_type.close

    def held_close(self: Any) -> None:
        closes.append(1)
        inside.set()
        second_started.wait(timeout=30)
        original(self)

    monkeypatch.setattr(conn_type, "close", held_close)
    first = threading.Thread(target=worker.kill)
    first.start()
    assert inside.wait(timeout=30)
    errors: list[BaseException] = []

    def second_kill() -> None:
        try:
            worker.kill()
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    second = threading.Thread(target=second_kill)
    second.start()
    second_started.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert not errors and closes == [1] and worker.conn.closed and not worker.alive
