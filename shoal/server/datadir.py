"""One server per data dir: an exclusive OS file lock held for the server's whole life.

Two servers on one data dir would both resume the same unfinished batches and compute their
requests twice; the lock makes the second one stop at start-up with a clear message instead.
The lock dies with the process (kill -9 included), so nothing stale is left to clean up.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from shoal.errors import ShoalError


class DataDirBusyError(ShoalError):
    """Another live process holds the data dir."""


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "shoal.lock"
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the server's life
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise DataDirBusyError(
                f"the data dir {self.path.parent} is in use by {holder}: "
                "stop that server or give this one another --data-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"shoal server pid {os.getpid()}")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the lock
            self._file = None
