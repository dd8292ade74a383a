"""`AsyncEngine`: the engine on a background thread, streamed to asyncio callers.

The step loop owns the engine on one thread; callers on any event loop submit requests and
receive snapshots through their own queue. Leaving the `async for` early (a client
disconnect, a cancelled task) aborts the request, which frees its blocks on the next step.
Anything else that changes engine state (reset, dropping a session, saving) is handed to the
step thread with `call` and runs between two steps, never during one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from shoal.engine.protocol import EngineProtocol
from shoal.errors import EngineClosedError
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams

T = TypeVar("T")
_Listener = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncEngine:
    def __init__(self, engine: EngineProtocol) -> None:
        self.engine = engine
        self._listeners: dict[str, _Listener] = {}
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._loop_done = False
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
        engine.step_thread = self._thread
        self._thread.start()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of one request until it finishes; typed errors raise at once."""
        if self._stopping:
            raise EngineClosedError("the engine is shutting down")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            request_id = self.engine.add_request(prompt, params, request_id, **kwargs)
            self._listeners[request_id] = (loop, queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._listeners.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the step thread between two steps; its result or its error."""
        future: Future[T] = Future()
        with self._lock:
            if self._loop_done:  # no step thread any more: the caller's thread is the one
                return fn(*args)
            self._calls.put((lambda: fn(*args), future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def drop_session(self, session_id: str) -> bool:
        return await self.call(self.engine.drop_session, session_id)

    async def save_sessions(self) -> int:
        return await self.call(self.engine.save_sessions)

    async def reset(self) -> list[RequestOutput]:
        outputs = await self.call(self.engine.reset)
        self._deliver(outputs)
        return outputs

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._run_calls()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # deliver the failure to everyone waiting
                    self._broadcast(e)
                    continue
                self._deliver(outputs)
        finally:
            with self._lock:
                self._loop_done = True
                self.engine.step_thread = None
            self._run_calls()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                listener = self._listeners.get(out.request_id)
                if listener is not None:
                    listener[0].call_soon_threadsafe(listener[1].put_nowait, out)

    def _broadcast(self, error: BaseException) -> None:
        with self._lock:
            for loop, q in self._listeners.values():
                loop.call_soon_threadsafe(q.put_nowait, error)
        self.engine.reset()

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish (up to a timeout), then stop."""
        self.engine.close()
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while self.engine.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                await self.reset()
                break
            await asyncio.sleep(0.01)
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
