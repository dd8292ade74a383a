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
from dataclasses import dataclass
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
    port: int
    proc: subprocess.Popen[bytes]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


@contextmanager
def local_postgres(timeout_s: float = 60) -> Iterator[LocalPostgres]:
    bindir = pg_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL is not installed (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="shoal-pg-"))
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = {"user": "postgres", "group": "postgres", "extra_groups": []}
    data, log = root / "data", root / "postgres.log"
    subprocess.run(
        [bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "-N"],
        check=True,
        capture_output=True,
        cwd=root,
        **as_user,
    )
    port = free_port()
    settings = ["fsync=off", "synchronous_commit=off", "full_page_writes=off"]
    args: list[Any] = [bindir / "postgres", "-D", data, "-p", port, "-h", "127.0.0.1", "-k", root]
    for s in settings:
        args += ["-c", s]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(a) for a in args], stdout=out, stderr=subprocess.STDOUT, cwd=root, **as_user
        )
    server = LocalPostgres(port, proc)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(server.url(), connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not start: {log.read_text()}") from None
                time.sleep(0.1)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)  # a fast shutdown: clients are disconnected
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
