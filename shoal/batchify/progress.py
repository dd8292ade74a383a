"""What the user sees while batches run: a live table on a terminal, log lines otherwise.

The batcher reports calls queued and each batch's state (queued, submitted, in progress,
done, failed); the display never moves a batch's count backwards, even when a provider's
counters do (Anthropic's stay at 0 until the batch ends).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("shoal.batchify")


@dataclass(slots=True)
class Row:
    label: str  # adapter, endpoint and model
    size: int
    state: str = "queued"
    batch_id: str | None = None
    done: int = 0
    failed: int = 0


@dataclass(slots=True)
class Board:
    """The state shown: requests waiting in queues, and one row per batch."""

    queued: int = 0
    rows: dict[str, Row] = field(default_factory=dict)

    def update(self, tag: str, **changes: Any) -> tuple[Row, bool]:
        """Apply `changes` to the row of `tag`; (row, whether its state changed)."""
        row = self.rows[tag]
        before = row.state
        for name, value in changes.items():
            if name in ("done", "failed"):
                value = max(value, getattr(row, name))
            setattr(row, name, value)
        return row, row.state != before


class Progress:
    """Log lines on each state change; the base for the live display."""

    def __init__(self) -> None:
        self.board = Board()

    def queued(self, delta: int) -> None:
        self.board.queued += delta

    def batch(self, tag: str, label: str, size: int) -> None:
        self.board.rows[tag] = Row(label, size)

    def update(self, tag: str, **changes: Any) -> None:
        row, changed = self.board.update(tag, **changes)
        if changed:
            log.info(
                "batch %s (%s, %d requests): %s %d/%d",
                row.batch_id or tag[:8],
                row.label,
                row.size,
                row.state,
                row.done,
                row.size,
            )

    def close(self) -> None:
        pass


class LiveProgress(Progress):
    """A rich Live table on stderr, refreshed by rich's own thread."""

    def __init__(self) -> None:
        super().__init__()
        from rich.console import Console
        from rich.live import Live

        self._live = Live(
            get_renderable=self._render, console=Console(stderr=True), refresh_per_second=2
        )
        self._live.start()

    def update(self, tag: str, **changes: Any) -> None:
        self.board.update(tag, **changes)

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title=f"shoal batchify · {self.board.queued} queued", title_justify="left")
        for name in ("batch", "requests", "state", "done", "failed"):
            table.add_column(name)
        for tag, row in list(self.board.rows.items()):
            table.add_row(
                f"{row.batch_id or tag[:8]} {row.label}",
                str(row.size),
                row.state,
                str(row.done),
                str(row.failed),
            )
        return table

    def close(self) -> None:
        self._live.stop()


def make_progress(live: bool | None = None) -> Progress:
    """`live=None`: a live table only on a real terminal outside CI."""
    if live is None:
        live = (
            sys.stderr.isatty()
            and os.environ.get("TERM", "dumb") != "dumb"
            and not os.environ.get("CI")
        )
    return LiveProgress() if live else Progress()
