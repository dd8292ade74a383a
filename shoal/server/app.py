"""`create_app` builds the FastAPI app; `run_server` runs it under uvicorn with graceful shutdown.

Lifespan: lock the data dir, open the store (`--store`: SQLite in the data dir, or a shared
PostgreSQL), load the engine (sessions persist under `<data dir>/sessions`), run the store's
unfinished batches with the other replicas. While running, idle moments save session KV, so
a kill -9 loses at most the turns since the engine was last idle. On shutdown: refuse new
requests (503) and fail those waiting for a grammar compile (never waited for), let in-flight
HTTP requests finish (uvicorn waits for them), give batch requests a grace period and leave
the rest for the resume, drain the engine, save sessions, close the store, unlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException

from shoal.engine.async_engine import AsyncEngine
from shoal.engine.protocol import EngineProtocol, create_engine
from shoal.errors import ShoalError
from shoal.quota.errors import QuotaError
from shoal.quota.http import create_router
from shoal.quota.metrics import QuotaMetrics
from shoal.server import batches, files, kv_routes, routes
from shoal.server.anthropic import batches as anthropic_batches
from shoal.server.anthropic import messages as anthropic_messages
from shoal.server.batch_runner import BatchRunner
from shoal.server.datadir import DataDirBusyError, DataDirLock
from shoal.server.errors import install_handlers
from shoal.server.keys import KeysError
from shoal.server.line_gate import LineGate
from shoal.server.metrics import ServerMetrics
from shoal.server.middleware import Guard
from shoal.server.quota import QuotaGate
from shoal.server.replica import replica_id
from shoal.server.responses import routes as responses_routes
from shoal.server.responses.service import Responses
from shoal.server.serving import Serving
from shoal.server.state import ServerConfig, ServerState
from shoal.server.store import Store, StoreError, open_store
from shoal.server.tenancy import DEFAULT, Tenancy, Tenant, get_tenant

log = logging.getLogger("shoal.server")


def build_engine(config: ServerConfig) -> EngineProtocol:
    """The server's engine: its `EngineConfig` (whose `backend` picks torch or MLX), with
    session KV kept under the data dir."""
    cache_dir = config.engine.cache_dir or str(config.data_dir / "sessions")
    return create_engine(dataclasses.replace(config.engine, cache_dir=cache_dir))


async def _save_sessions_when_idle(aeng: AsyncEngine, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        if not aeng.engine.has_unfinished_requests():
            await aeng.save_sessions()


def create_app(
    config: ServerConfig, engine: EngineProtocol | None = None, store: Store | None = None
) -> FastAPI:
    """The app; the engine loads and the store opens at startup unless given. With a quota
    config, its routes are served too and requests are admitted through it
    (`server/quota.py`). A keys file that cannot be used raises `KeysError` here."""
    tenancy = Tenancy(config.api_key, config.keys_file)
    gate = QuotaGate.open(config.quota_config, config.data_dir) if config.quota_config else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lock = DataDirLock(config.data_dir)
        lock.acquire()
        db = store or open_store(config.store_url)
        eng = engine or build_engine(config)
        _tokenize_shared(tenancy, eng)
        aeng = AsyncEngine(eng)
        serving = Serving(eng, aeng, ServerMetrics(eng, config.describe()), config.schema_limits)
        if gate is not None:  # the quota's counters and usage join the server's /metrics
            gate.service.metrics = QuotaMetrics(gate.service, serving.metrics.registry)
        replica = replica_id(config.data_dir)
        responses = Responses(
            serving, db, replica, config.responses_keep, config.responses_max_age_s
        )
        runner = BatchRunner(
            db,
            serving,
            concurrency=config.batch_concurrency or 2 * eng.config.max_num_seqs,
            max_lines=config.max_batch_lines,
            priority=config.batch_priority,
            replica=replica,
            lease_s=config.batch_lease_s,
            responses=responses,
            gate=LineGate(config.batch_gate) if config.batch_gate else None,
            tenancy=tenancy,
        )
        state = ServerState(config, serving, db, runner, gate, responses=responses, tenancy=tenancy)
        app.state.shoal = state
        await responses.start()
        runner.start()
        saver = asyncio.create_task(_save_sessions_when_idle(aeng, config.session_save_s))
        log.info("shoal serving %s", state.model_name)
        try:
            yield
        finally:
            state.shutting_down = True
            saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await saver
            await runner.stop(config.batch_grace_s)
            await responses.close()
            await aeng.shutdown(config.drain_timeout_s)
            eng.save_sessions()
            db.close()
            if gate is not None:
                await gate.aclose()
            lock.release()

    app = FastAPI(
        title="shoal",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible completions, chat, Responses and Batch API; Anthropic "
        "Messages and Message Batches.",
    )
    app.state.tenancy = tenancy
    install_handlers(app)
    app.include_router(routes.router)
    app.include_router(responses_routes.router)
    app.include_router(kv_routes.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(anthropic_messages.router)
    app.include_router(anthropic_batches.router)
    if gate is not None:
        operator = [Depends(_operator_only)] if tenancy.keyed else []
        app.include_router(create_router(gate.service, health=False), dependencies=operator)
    app.add_middleware(
        Guard,
        tenancy=tenancy,
        metrics_key=config.metrics_key,
        max_body=config.max_body_bytes,
        max_upload=config.max_upload_bytes,
    )
    return app


def _tokenize_shared(tenancy: Tenancy, engine: EngineProtocol) -> None:
    try:
        tenancy.tokenize(engine.encode)
    except ShoalError as e:  # no tokenizer: only shared_prefix_tokens can be declared
        log.warning("shared_prefix texts are not used: %s", e)


def _operator_only(tenant: Annotated[Tenant, Depends(get_tenant)]) -> None:
    """The quota service's routes spend and change any budget: with `--keys`, they answer
    the `default` tenant (the operator's `--api-key`) only; to the others they are not there."""
    if tenant.name != DEFAULT:
        raise HTTPException(404, "Not Found")


def run_server(config: ServerConfig, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully; SIGHUP reloads the keys file.
    Exit at once, before the model loads, if the data dir belongs to another live server (1)
    or the store, the quota backend or the keys file cannot be used (2)."""
    import uvicorn

    probe = DataDirLock(config.data_dir)
    try:
        probe.acquire()
    except DataDirBusyError as e:
        print(f"shoal serve: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    probe.release()
    try:
        app = create_app(config, store=open_store(config.store_url))
    except (StoreError, QuotaError, KeysError) as e:
        print(f"shoal serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    tenancy: Tenancy = app.state.tenancy

    def reload_keys(sig: int, frame: FrameType | None) -> None:
        try:
            tenancy.reload()
        except Exception as e:  # the server keeps the keys it had (never raised into the loop)
            log.error("keys not reloaded: %s", e)

    signal.signal(signal.SIGHUP, reload_keys)  # key rotation: edit the file, then kill -HUP

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state = getattr(app.state, "shoal", None)
            if state is not None:  # refuse new requests (503) from the first signal on
                state.shutting_down = True
                # and fail the requests waiting for a grammar (uvicorn waits for them): from
                # a thread, as the signal may have interrupted a holder of the engine's locks
                threading.Thread(target=state.engine.close, daemon=True).start()
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30
    )
    Server(uv_config).run()
