"""`create_app` builds the FastAPI app; `serve` runs it under uvicorn with graceful shutdown.

Lifespan: load the engine, open the store, resume unfinished batches. On shutdown: refuse new
requests (503), let in-flight HTTP requests finish (uvicorn waits for them), give batch
requests a grace period and leave the rest for the resume, drain the engine, close the store.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from fastapi import FastAPI

from shoal.config import EngineConfig
from shoal.engine.async_engine import AsyncEngine
from shoal.engine.llm_engine import Engine
from shoal.server import batches, files, routes
from shoal.server.batch_runner import BatchRunner
from shoal.server.errors import install_handlers
from shoal.server.metrics import ServerMetrics
from shoal.server.middleware import Guard
from shoal.server.state import ServerConfig, ServerState
from shoal.server.store import Store

log = logging.getLogger("shoal.server")


def build_engine(config: ServerConfig) -> Engine:
    kw: dict[str, Any] = {}
    if config.num_blocks is not None:
        kw["num_blocks"] = config.num_blocks
    return Engine(
        EngineConfig(
            model=config.model,
            dtype=config.dtype,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_waiting=config.max_waiting,
            **kw,
        )
    )


def create_app(config: ServerConfig, engine: Engine | None = None) -> FastAPI:
    """The app; the engine loads at startup unless one is given."""
    holder: dict[str, ServerState] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = engine or build_engine(config)
        aeng = AsyncEngine(eng)
        store = Store(config.data_dir)
        state_box: list[ServerState] = []

        async def execute(
            endpoint: str, body: dict[str, Any]
        ) -> tuple[int, dict[str, Any], int, int]:
            return await batches.execute_line(state_box[0], endpoint, body)

        runner = BatchRunner(
            store,
            execute,
            concurrency=config.batch_concurrency or 2 * config.max_num_seqs,
            max_lines=config.max_batch_lines,
        )
        state = ServerState(
            config=config,
            engine=eng,
            aeng=aeng,
            store=store,
            runner=runner,
            metrics=ServerMetrics(eng),
        )
        state_box.append(state)
        holder["state"] = state
        app.state.shoal = state
        runner.start()
        log.info("shoal serving %s", state.model_name)
        try:
            yield
        finally:
            state.shutting_down = True
            await runner.stop(config.batch_grace_s)
            await aeng.shutdown(config.drain_timeout_s)
            eng.save_sessions()
            store.close()

    app = FastAPI(
        title="shoal",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible completions, chat and Batch API.",
    )
    install_handlers(app)
    app.include_router(routes.router)
    app.include_router(files.router)
    app.include_router(batches.router)

    def shutting_down() -> bool:
        state = holder.get("state")
        return state is not None and state.shutting_down

    app.add_middleware(
        Guard,
        api_key=config.api_key,
        max_body=config.max_body_bytes,
        max_upload=config.max_upload_bytes,
        shutting_down=shutting_down,
    )
    app.state.holder = holder
    return app


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        data_dir=Path(args.data_dir),
        api_key=args.api_key,
    )


def serve(args: argparse.Namespace) -> None:
    """`shoal serve`: run until SIGINT/SIGTERM, then shut down gracefully."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_server(config_from_args(args), args.host, args.port)


def run_server(config: ServerConfig, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    app = create_app(config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state = app.state.holder.get("state")
            if state is not None:  # refuse new requests (503) from the first signal on
                state.shutting_down = True
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30
    )
    Server(uv_config).run()
