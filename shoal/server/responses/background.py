"""Background responses running on this server: each one's task and the log of its stream's
events, which any number of clients follow (`POST` with `stream`, `GET ...?stream=true`),
from the start or after a sequence number, while the task goes on whoever listens.

A client that goes away stops following; only `cancel` (or `DELETE`) stops the task. When the
server stops, the tasks end as failed responses; a server that died mid-response fails its
leftovers when it starts again (`Responses.start`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class EventLog:
    """A response's events in order (event `i` has sequence number `i`)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(self, event: dict[str, Any]) -> None:
        async with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    async def end(self) -> None:
        async with self._changed:
            self.done = True
            self._changed.notify_all()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events after `starting_after`, as they come, until the log ends."""
        sent = max(0, starting_after + 1)
        while True:
            async with self._changed:
                await self._changed.wait_for(self._beyond(sent))
                batch, done = self.events[sent:], self.done
            for event in batch:
                yield event
            sent += len(batch)
            if done and sent >= len(self.events):
                return

    def _beyond(self, sent: int) -> Callable[[], bool]:
        return lambda: len(self.events) > sent or self.done


@dataclass(eq=False)
class Running:
    log: EventLog
    task: asyncio.Task[None] | None = None


class BackgroundTasks:
    def __init__(self) -> None:
        self._running: dict[str, Running] = {}
        self.closing = False  # the server is stopping: tasks end as failed, not cancelled

    def get(self, response_id: str) -> Running | None:
        return self._running.get(response_id)

    def add(self, response_id: str, running: Running) -> None:
        self._running[response_id] = running

    def remove(self, response_id: str) -> None:
        self._running.pop(response_id, None)

    async def stop(self, response_id: str) -> None:
        """Cancel a running response's task (if it runs here) and wait for it to end."""
        running = self._running.get(response_id)
        if running is not None and running.task is not None:
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)

    async def close(self) -> None:
        self.closing = True
        for response_id in list(self._running):
            await self.stop(response_id)
