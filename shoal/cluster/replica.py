"""`EngineReplica`: one engine of the cluster, a Ray Serve deployment around the very app
`shoal serve` runs (`server.app.create_app`: engine, sessions, Files and Batch APIs, metrics),
hosted in the replica's actor by `asgi.AsgiHost`. The ingress forwards whole HTTP requests to
`handle` and streams the answer back, so routes, errors, streaming and metrics are the server's
own. Every answer names its replica (`x-shoal-replica`).

Each replica keeps its own data dir, `<data dir>/replica-<rank>`: a replica that Ray Serve
starts in place of a dead one takes the free rank, and so the dead one's spilled sessions and
(with the default SQLite store) its batches. Session KV is shared through the session tier
(`EngineConfig.session_tier_dir`), which every replica must see at the same path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from ray import serve

from shoal.cluster.asgi import AsgiHost, Forwarded, ResponseHead
from shoal.cluster.routing import Route
from shoal.server.app import create_app
from shoal.server.datadir import DataDirBusyError, DataDirLock
from shoal.server.state import ServerConfig

REPLICA_HEADER = "x-shoal-replica"


class EngineReplica:
    async def __init__(self, config: ServerConfig) -> None:  # type: ignore[misc]  # Serve awaits it
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        rank = ctx.rank.rank if ctx.rank is not None else self.replica_id
        data_dir = free_data_dir(config.data_dir, [f"replica-{rank}", f"replica-{self.replica_id}"])
        self.host = AsgiHost(create_app(dataclasses.replace(config, data_dir=data_dir)))
        await self.host.start()

    async def handle(
        self, request: Forwarded, route: Route | None = None
    ) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer, head first. `route` is the request router's (it chose this
        replica by it); the app does not need it."""
        async for part in self.host.serve(request):
            if isinstance(part, ResponseHead):
                part.headers.append((REPLICA_HEADER.encode(), self.replica_id.encode()))
            yield part

    async def __del__(self) -> None:
        await self.host.stop()


def free_data_dir(base: Path, names: list[str]) -> Path:
    """The first of `base / name` no live server holds (a replica being replaced may still)."""
    for name in names:
        lock = DataDirLock(base / name)
        try:
            lock.acquire()
        except DataDirBusyError:
            continue
        lock.release()
        return base / name
    raise DataDirBusyError(f"every data dir of this replica under {base} is in use")
