"""`AsyncEngine`: the engine on a background thread, streamed to asyncio callers.

The step loop owns the engine on one thread; callers on any event loop submit requests and
receive snapshots through their own queue. Leaving the `async for` early (a client
disconnect, a cancelled task) aborts the request, which frees its blocks on the next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from shoal.engine.llm_engine import Engine
from shoal.errors import EngineClosedError
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams

_Listener = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._listeners: dict[str, _Listener] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
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

    def _loop(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs: list[RequestOutput] = self.engine.step()
            except BaseException as e:  # deliver the failure to everyone waiting
                self._broadcast(e)
                continue
            with self._lock:
                for out in outputs:
                    listener = self._listeners.get(out.request_id)
                    if listener is not None:
                        listener[0].call_soon_threadsafe(listener[1].put_nowait, out)

    def _broadcast(self, error: BaseException) -> None:
        with self._lock:
            for loop, queue in self._listeners.values():
                loop.call_soon_threadsafe(queue.put_nowait, error)
        self.engine.reset()

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish (up to a timeout), then stop."""
        self.engine.close()
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while self.engine.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                self.engine.reset()
                break
            await asyncio.sleep(0.01)
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
