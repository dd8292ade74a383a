"""`RequestTable`: the requests an engine has taken and not yet finished, by id, with the rules
every backend applies when taking one (a closed engine, an id in use, a full queue).

Thread-safe the way the engines need it: callers hold `lock` from `check_new` through queueing
the request and recording it, and around `get` with the abort it resolves.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from shoal.errors import EngineClosedError, InvalidRequestError, QueueFullError

T = TypeVar("T")


class RequestTable(Generic[T]):
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.lock = threading.Lock()
        self.closed = False
        self._items: dict[str, T] = {}

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the engine is shut down")

    def check_new(self, request_id: str) -> None:
        """Typed errors for an id in use or a full queue (hold `lock`)."""
        if request_id in self._items:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(self._items) >= self.max_waiting:
            raise QueueFullError("too many requests are queued")

    def __setitem__(self, request_id: str, item: T) -> None:
        self._items[request_id] = item  # (hold `lock`)

    def get(self, request_id: str) -> T | None:
        return self._items.get(request_id)

    def pop(self, request_id: str) -> None:
        with self.lock:
            self._items.pop(request_id, None)

    def values(self) -> list[T]:
        with self.lock:
            return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)  # one atomic read: no lock needed
