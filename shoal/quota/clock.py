"""The limiter's clock. Time is always the service's, never a client's: clients on other
machines disagree about it, and a rolling window is only as fair as its clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The wall clock: expiry times are stored and must mean the same after a restart. Backends
    guard it with the largest time they have stored, so a clock moved back frees nothing early."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000
