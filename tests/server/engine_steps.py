"""`EngineSteps`: a test's hold on an engine's step loop (an `Engine` driven by `AsyncEngine`,
alone or inside a live in-thread server).

It records which requests arrived (with their priority) and finished, in order, and can hold
the loop: a held step does nothing (the loop still runs control calls between steps), so a
test stops the engine in the state it needs (a line running, others queued; nothing finished
yet) on any CPU, instead of hoping a request lasts long enough or a sleep is short enough.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shoal.outputs import RequestOutput

HELD_WAIT_S = 0.005  # a held step waits this long for a release before the loop goes round


@dataclass
class EngineSteps:
    engine: Any
    arrived: list[tuple[str, int]] = field(default_factory=list)  # (request id, priority)
    finished: list[str] = field(default_factory=list)
    steps: int = 0  # steps run (held ones not counted)
    _budget: int | None = None  # steps still allowed; None: run freely
    _hold_when: Callable[[], bool] | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def _add_request(self, *args: Any, **kw: Any) -> str:
        request_id: str = type(self.engine).add_request(self.engine, *args, **kw)
        with self._cond:
            self.arrived.append((request_id, kw.get("priority", 0)))
            self._cond.notify_all()
        return request_id

    def _step(self) -> list[RequestOutput]:
        with self._cond:
            if self._budget == 0:
                self._cond.wait(HELD_WAIT_S)
                return []
            if self._budget is not None:
                self._budget -= 1
        outputs: list[RequestOutput] = type(self.engine).step(self.engine)
        with self._cond:
            self.steps += 1
            self.finished += [o.request_id for o in outputs if o.finished]
            if self._hold_when is not None and self._hold_when():
                self._budget, self._hold_when = 0, None
            self._cond.notify_all()
        return outputs

    def hold(self, when: Callable[[], bool] | None = None) -> None:
        """Hold the loop from its next step on (or, with `when`, after the first step that
        makes `when()` true; it runs on the step thread, under the lock)."""
        with self._cond:
            if when is None:
                self._budget = 0
            else:
                self._hold_when = when
            self._cond.notify_all()

    def allow(self, steps: int) -> None:
        """Let the held loop run `steps` more steps, then hold again."""
        with self._cond:
            self._budget = (self._budget or 0) + steps
            self._cond.notify_all()

    def step_once(self) -> None:
        """Run one more step of the held loop and wait for it (or for the engine to have
        nothing left to run)."""
        done = self.steps
        self.allow(1)
        self.wait(lambda: self.steps > done or not self.engine.has_unfinished_requests())

    def release(self) -> None:
        with self._cond:
            self._budget, self._hold_when = None, None
            self._cond.notify_all()

    def wait(self, what: Callable[[], bool], timeout: float = 60) -> None:
        """Until `what()` holds (checked under the lock at each arrival and step)."""
        with self._cond:
            assert self._cond.wait_for(what, timeout), "the engine never reached the state"

    def ids(self, priority: int) -> list[str]:
        return [rid for rid, p in self.arrived if p == priority]


@contextmanager
def engine_steps(engine: Any) -> Iterator[EngineSteps]:
    """`EngineSteps` on `engine` for the block; the loop runs freely again after it."""
    steps = EngineSteps(engine)
    engine.add_request, engine.step = steps._add_request, steps._step
    try:
        yield steps
    finally:
        steps.release()
        del engine.add_request, engine.step
