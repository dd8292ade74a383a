"""`LineGate`: a test hook that holds answered batch lines before their results are stored.

Tests of the batch runner's guarantees (a replica killed mid-batch loses nothing and writes
nothing twice; a cancel stops every replica) need lines provably claimed and in flight when
the kill or the cancel lands, whatever the CPU's speed. A folder, shared by every process that
runs the batch, is the gate. While `<folder>/closed` exists, each answered line waits before
its result is written and is listed as `<folder>/held/<pid>-<n>` (its custom id inside) for as
long as it waits; the number written in `closed` (0 if none) is how many lines still pass
first, each taking a pass file (`passes/<k>`, created exclusively, so processes sharing the
gate never let more through). Off unless `ServerConfig.batch_gate` names the folder.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

POLL_S = 0.01


class LineGate:
    def __init__(self, folder: Path) -> None:
        self.closed = folder / "closed"
        self.held = folder / "held"
        self.passes = folder / "passes"
        self._count = itertools.count()

    async def hold(self, custom_id: str) -> None:
        """Return once the gate is open or lets this line pass; meanwhile list it as held."""
        if not self.closed.exists() or self._take_pass():
            return
        self.held.mkdir(parents=True, exist_ok=True)
        marker = self.held / f"{os.getpid()}-{next(self._count)}"
        marker.write_text(custom_id)
        try:
            while self.closed.exists():
                await asyncio.sleep(POLL_S)
        finally:
            marker.unlink(missing_ok=True)

    def _take_pass(self) -> bool:
        try:
            allowed = int(self.closed.read_text() or 0)
        except FileNotFoundError:  # opened meanwhile
            return True
        self.passes.mkdir(parents=True, exist_ok=True)
        for k in range(allowed):
            try:
                (self.passes / str(k)).touch(exist_ok=False)
                return True
            except FileExistsError:
                continue
        return False
