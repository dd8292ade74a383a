"""What the server holds at run time: its configuration, the serving path, the store (files and
batches, maybe shared with other replicas), the runner, its tenants (`--keys`) and, with
`--quota`, the quota gate.

One `ServerState` per app, set as `app.state.shoal` when the app starts and reached through
`request.app.state` (never module globals), so several servers can run in one process (the
tests do) without sharing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request

from shoal.config import EngineConfig
from shoal.server.schema_check import SchemaLimits
from shoal.server.store import Store
from shoal.server.tenancy import Tenancy
from shoal.urls import redact

if TYPE_CHECKING:
    from shoal.engine.protocol import EngineProtocol
    from shoal.server.batch_runner import BatchRunner
    from shoal.server.quota import QuotaGate
    from shoal.server.responses.service import Responses
    from shoal.server.serving import Serving

MiB = 1 << 20
STORE_FILE = "shoal.sqlite3"  # the default store: SQLite in the data dir


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_waiting=1024))
    data_dir: Path = Path("./shoal-data")
    api_key: str | None = None  # the `default` tenant's key
    keys_file: Path | None = None  # `--keys`: named keys, each a tenant's (`server/keys.py`)
    metrics_key: str | None = None  # `/metrics` asks for it when set
    max_body_bytes: int = 8 * MiB  # JSON bodies
    max_upload_bytes: int = 200 * MiB  # file uploads
    max_batch_lines: int = 50_000
    batch_concurrency: int = 0  # batch requests in flight at once; 0 = 2 x max_num_seqs
    batch_priority: int = 1
    batch_window_s: int | None = None  # overrides the 24h completion window (tests, operators)
    drain_timeout_s: float = 10.0
    batch_grace_s: float = 2.0
    session_save_s: float = 1.0  # how often an idle engine writes unsaved session KV to disk
    quota_config: Path | None = None  # `--quota`: a limits file with a [serve] budget
    store: str | None = None  # `--store`: a path, sqlite:///... or postgresql://...
    batch_lease_s: float = 10.0  # a dead replica's batch lines are re-taken after this
    responses_keep: int = 100_000  # stored responses kept at most (the oldest go first)
    responses_max_age_s: float = 30 * 86400.0  # and for at most this long
    batch_gate: Path | None = None  # a test hook: see `server.line_gate`
    schema_limits: SchemaLimits = field(default_factory=SchemaLimits)  # `--max-schema-*`
    keep_billing_header: bool = False  # Claude Code's per-request system line (`anthropic/caching`)

    @property
    def store_url(self) -> str:
        """The batch store: `store`, else SQLite in the data dir."""
        return self.store or str(self.data_dir / STORE_FILE)

    def describe(self) -> dict[str, str]:
        """The server's own settings, as `/metrics` shows them (never the API key)."""
        return {
            "data_dir": str(self.data_dir),
            "store": redact(self.store_url),
            "auth": "keys" if self.keys_file else "bearer" if self.api_key else "none",
            "batch_concurrency": str(self.batch_concurrency),
            "max_batch_lines": str(self.max_batch_lines),
            "max_body_bytes": str(self.max_body_bytes),
            "max_upload_bytes": str(self.max_upload_bytes),
        }


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    serving: Serving
    store: Store
    runner: BatchRunner
    quota: QuotaGate | None = None
    shutting_down: bool = False
    responses: Responses | None = None
    tenancy: Tenancy = field(default_factory=Tenancy)

    @property
    def engine(self) -> EngineProtocol:
        return self.serving.engine

    @property
    def model_name(self) -> str:
        return self.serving.model_name


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shoal
    return state
