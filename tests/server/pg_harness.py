"""A throwaway PostgreSQL for tests: `initdb` in a temporary folder, `postgres` on a free
127.0.0.1 port, stopped and removed at the end; each test takes a fresh database in it.

Debian's `postgresql` package (`make test` installs it) keeps its programs in
`/usr/lib/postgresql/<version>/bin`, off the PATH. PostgreSQL refuses to run as root, so under
root (CI) the cluster runs as the `postgres` system user the package creates.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from server_harness import free_port


def pg_bindir() -> Path | None:
    """The folder holding `initdb` and `postgres`: on the PATH, else Debian's newest."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)],
    )
    return versions[-1].parent if versions else None


@dataclass
class LocalPostgres:
    """A cluster in `root` (initdb'd); `start`/`stop` keep its data, as a restart would."""

    root: Path
    bindir: Path
    as_user: dict[str, Any]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def start(self, timeout_s: float = 60) -> None:
        settings = ["fsync=off", "synchronous_commit=off", "full_page_writes=off"]
        args: list[Any] = [self.bindir / "postgres", "-D", self.root / "data", "-p", self.port]
        args += ["-h", "127.0.0.1", "-k", self.root]
        for setting in settings:
            args += ["-c", setting]
        log = self.root / "postgres.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(a) for a in args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                **self.as_user,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not start: {log.read_text()}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown: clients are disconnected, the data stays."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def local_postgres() -> Iterator[LocalPostgres]:
    bindir = pg_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL is not installed (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="shoal-pg-"))
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = {"user": "postgres", "group": "postgres", "extra_groups": []}
    server = LocalPostgres(root, bindir, as_user)
    try:
        initdb = [bindir / "initdb", "-D", root / "data", "-U", "postgres", "--auth=trust"]
        subprocess.run(
            [*initdb, "-E", "UTF8", "-N"],
            check=True,
            capture_output=True,
            cwd=root,
            **as_user,
        )
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
