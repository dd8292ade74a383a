"""Live-server fixtures shared by the server and batchify tests (their conftests import them):
a tiny model with a tokenizer, and live uvicorn servers on 127.0.0.1.

`server` is one shared in-thread server (its engine is reachable for pool checks);
`start_server(**config)` starts more with other settings; `spawn_server(data_dir)` runs one
in a subprocess (for kill -9 and SIGTERM tests). Every server stops itself. `postgres` is one
throwaway PostgreSQL for the session; `fresh_store(request, kind)` gives a test its own store,
`store` an open, empty one of each kind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_harness import LiveServer, SpawnedServer, free_port, serve_in_thread
from server_tiny_model import build_tiny_model

from shoal.config import EngineConfig
from shoal.server.state import ServerConfig
from shoal.server.store import Store, open_store

NUM_BLOCKS = 1024
HERE = Path(__file__).parent
STORES = ["sqlite", "postgresql"]  # the batch store kinds that tests run against


def _no_postgres(why: str) -> None:
    if os.environ.get("SHOAL_SKIP_POSTGRES_TESTS") == "1":
        pytest.skip(f"{why} and SHOAL_SKIP_POSTGRES_TESTS=1")
    pytest.fail(f"{why}: run `make test`, which installs it")


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A `pg_harness.LocalPostgres` for the whole session. Without PostgreSQL or psycopg the
    tests that need it fail, unless SHOAL_SKIP_POSTGRES_TESTS=1 says it cannot be installed."""
    try:
        from pg_harness import local_postgres, pg_bindir
    except ImportError as e:
        _no_postgres(f"psycopg is not installed ({e})")
    if pg_bindir() is None:
        _no_postgres("PostgreSQL is not installed")
    with local_postgres() as server:
        yield server


def fresh_store(request: pytest.FixtureRequest, kind: str) -> str | None:
    """A new, empty store of `kind` for `--store` (None: SQLite in the server's data dir)."""
    if kind == "sqlite":
        return None
    return str(request.getfixturevalue("postgres").new_database())


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    opened = open_store(fresh_store(request, request.param) or tmp_path / "shoal.sqlite3")
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-chat-model"))


@pytest.fixture(scope="session")
def start_server(
    tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def start(engine: dict[str, Any] | None = None, **overrides: Any) -> LiveServer:
        """A server on the tiny model; `engine` holds `EngineConfig` overrides (another
        `model`, a `backend`...)."""
        overrides.setdefault("data_dir", tmp_path_factory.mktemp("data"))
        engine_kw = {"model": str(tiny_chat_model), "num_blocks": NUM_BLOCKS, "max_waiting": 1024}
        engine_config = EngineConfig(**{**engine_kw, **(engine or {})})
        config = ServerConfig(engine=engine_config, **overrides)
        live = serve_in_thread(config)
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., LiveServer]) -> LiveServer:
    return start_server()


@pytest.fixture(scope="session")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tools_server(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    """The tiny model with room for prompts that present tools (4,096 positions)."""
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-long-model"), max_positions=4096)
    return start_server(engine={"model": str(model)})


@pytest.fixture
def spawn_command(tmp_path: Path) -> Iterator[Callable[..., SpawnedServer]]:
    """`spawn_command(lambda port: [...argv...])`: a server process on a free port, ready."""
    procs: list[SpawnedServer] = []

    def spawn(argv: Callable[[int], list[str]]) -> SpawnedServer:
        for attempt in range(3):  # a free port can be taken before the child binds it
            port = free_port()
            log = tmp_path / f"server-{port}.log"
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    argv(port), stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ)
                )
            spawned = SpawnedServer(f"http://127.0.0.1:{port}", proc, log)
            procs.append(spawned)
            try:
                spawned.wait_ready()
                return spawned
            except RuntimeError:
                if attempt == 2 or "address already in use" not in log.read_text().lower():
                    raise
        raise AssertionError("unreachable")

    yield spawn
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)


@pytest.fixture
def spawn_server(
    tiny_chat_model: Path, spawn_command: Callable[..., SpawnedServer]
) -> Callable[..., SpawnedServer]:
    """A test server (`serve_tiny.py`: the tiny model, a small pool) in its own process."""

    def spawn(data_dir: Path, *extra: str) -> SpawnedServer:
        return spawn_command(
            lambda port: [
                sys.executable,
                str(HERE / "serve_tiny.py"),
                "--model",
                str(tiny_chat_model),
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                "--num-blocks",
                str(NUM_BLOCKS),
                *extra,
            ]
        )

    return spawn
