"""What the server holds at run time: its configuration, the engine, the store, the runner.

One `ServerState` per app, reached through `request.app.state` rather than module globals, so
several servers can run in one process (the tests do) without sharing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request

from shoal.engine.async_engine import AsyncEngine
from shoal.engine.llm_engine import Engine

if TYPE_CHECKING:
    from shoal.server.batch_runner import BatchRunner
    from shoal.server.metrics import ServerMetrics
    from shoal.server.store import Store

MiB = 1 << 20


@dataclass(slots=True)
class ServerConfig:
    model: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    max_num_seqs: int = 64
    max_waiting: int = 1024  # queued + running requests before 429
    num_blocks: int | None = None
    data_dir: Path = Path("./shoal-data")
    api_key: str | None = None
    max_body_bytes: int = 8 * MiB  # JSON bodies
    max_upload_bytes: int = 200 * MiB  # file uploads
    max_batch_lines: int = 50_000
    batch_concurrency: int = 0  # batch requests in flight at once; 0 = 2 x max_num_seqs
    batch_priority: int = 1
    batch_window_s: int | None = None  # overrides the 24h completion window (tests, operators)
    drain_timeout_s: float = 10.0
    batch_grace_s: float = 2.0


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    engine: Engine
    aeng: AsyncEngine
    store: Store
    runner: BatchRunner
    metrics: ServerMetrics
    shutting_down: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shoal
    return state
