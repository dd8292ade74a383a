"""This server as one replica among those sharing a store: its name and its heartbeat.

The name is kept in the data dir, which one live server holds at a time (`DataDirLock`), so a
server restarted on its data dir takes back its own claims at once instead of waiting for them
to lapse. The heartbeat runs on a thread of its own, so a busy event loop cannot make a live
replica look dead; when it stops (kill -9, a lost machine), the replica's claims lapse after
`lease_s` and other replicas take its lines.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from pathlib import Path

from shoal.durable import atomic_write
from shoal.server.store import Store

log = logging.getLogger("shoal.server.batch")


def replica_id(data_dir: Path) -> str:
    """The replica name stored in `data_dir` (made on first use: host name + random)."""
    path = Path(data_dir) / "replica-id"
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        name = ""
    if not name:
        name = f"{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, name.encode())
    return name


class Heartbeat:
    """Renews `replica`'s lease every `lease_s / 3` until stopped."""

    def __init__(self, store: Store, replica: str, lease_s: float) -> None:
        self.store = store
        self.replica = replica
        self.lease_s = lease_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-heartbeat", daemon=True)

    def start(self) -> None:
        """Beat once now (so a store that cannot be reached fails the start), then go on."""
        self.store.heartbeat(self.replica, self.lease_s)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.lease_s / 3):
            try:
                self.store.heartbeat(self.replica, self.lease_s)
            except Exception:  # the store is away: keep trying; claims may lapse meanwhile
                log.warning("heartbeat of replica %s failed", self.replica, exc_info=True)

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
