"""Helpers for testing code that uses quotas: a clock you move by hand, a throwaway Redis.

`local_redis()` runs Debian's (or any) `redis-server` binary on a free loopback port, with its
data in a folder of your choosing, and stops it on exit; `restart()` keeps the data, so a
test can show what survives.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis


class ManualClock:
    """A `Clock` that moves only when told to."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalRedis:
    """A `redis-server` this process started; `url` points at database 0."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
        ]
        # An append-only file, so state written before a stop is there after a start.
        args += ["--appendonly", "yes", "--save", "", "--daemonize", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        with self.client() as probe:
            while True:
                try:
                    probe.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on {self.port}") from None
                    time.sleep(0.02)

    def stop(self) -> None:
        """Shut down cleanly (the append-only file is flushed)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # SIGTERM: redis-server saves and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def local_redis(data_dir: str | Path) -> Iterator[LocalRedis]:
    server = LocalRedis(Path(data_dir))
    server.start()
    try:
        yield server
    finally:
        server.stop()
