"""Live servers for the server tests: in a thread (engine reachable) or in a subprocess."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from shoal.server.app import create_app
from shoal.server.state import ServerConfig, ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    data_dir: Path

    @property
    def state(self) -> ServerState:
        state: ServerState = self.server.config.app.state.shoal
        return state

    @property
    def model(self) -> str:
        return self.state.model_name

    def client(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class SpawnedServer:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become ready: {self.log.read_text()[-2000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def serve_in_thread(config: ServerConfig, port: int | None = None) -> LiveServer:
    """`config`'s app under uvicorn on 127.0.0.1, in a thread of this process; ready."""
    port = port or free_port()
    uv = uvicorn.Config(
        create_app(config),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(uv)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", server, thread, config.data_dir)


def wait_pool_whole(live: LiveServer, timeout: float = 60) -> bool:
    """Aborts free their blocks on the engine's next step: wait (bounded) for a whole pool."""
    pool = live.state.engine.pool
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool.num_free == pool.num_blocks and not live.state.engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return pool.num_free == pool.num_blocks
