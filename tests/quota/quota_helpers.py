"""Small builders shared by the quota tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from shoal.quota import (
    Actual,
    CompleteRequest,
    Limit,
    LimitKind,
    QuotaService,
    Requirement,
    ReserveRequest,
    new_lease_id,
)
from shoal.quota.testing import free_port

# The limits file exactly as issue 10 writes it.
ISSUE_EXAMPLE = """
[[limit]]
key = "global:llm:openai:gpt-4o:rpm"
kind = "rate"        # rolling window
capacity = 100
window_s = 60

[[limit]]
key = "global:jobs:concurrency"
kind = "concurrency"
capacity = 8
"""


def rate(key: str, capacity: int, window_s: float = 60) -> Limit:
    return Limit(key, LimitKind.RATE, capacity, window_s)


def concurrency(key: str, capacity: int, timeout_s: float = 300) -> Limit:
    return Limit(key, LimitKind.CONCURRENCY, capacity, timeout_s)


def reserve(
    *reqs: tuple[str, int], lease_id: str | None = None, job_id: str = ""
) -> ReserveRequest:
    """`reserve(("rpm", 1), ("tpm", 500))` under a fresh lease id unless one is given."""
    return ReserveRequest(
        lease_id or new_lease_id(), tuple(Requirement(k, a) for k, a in reqs), job_id
    )


def complete(lease_id: str, *actuals: tuple[str, int]) -> CompleteRequest:
    return CompleteRequest(lease_id, tuple(Actual(k, a) for k, a in actuals))


def used(service: QuotaService) -> dict[str, int]:
    return {u.key: u.used for u in service.usage()}


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a thread on a free loopback port; yields its URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
