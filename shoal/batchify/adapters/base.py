"""What every provider adapter provides: matching requests, and the Batch API round trip."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.batchify.calls import Outcome, Target
from shoal.batchify.errors import BatchifyError
from shoal.batchify.provider import ProviderHTTP

# Batches listed while looking for an orphan may carry timestamps from a skewed clock.
CLOCK_SKEW_S = 3600.0
# Per-request results: a response to hand back, or the error to raise in the caller.
Results = dict[str, Outcome | BatchifyError]


@dataclass(frozen=True, slots=True)
class Route:
    base_url: str  # scheme://host[:port][/prefix], e.g. "https://api.openai.com/v1"
    endpoint: str  # the batch endpoint, e.g. "/v1/chat/completions"


@dataclass(slots=True)
class Snapshot:
    """One poll of a batch, reduced to what the batcher and the progress display need."""

    status: str
    terminal: bool
    total: int
    done: int  # requests the provider has finished, successfully or not
    failed: int
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A provider batch that may be the orphan of an intent; `verified` when its tag proves it,
    otherwise its results' custom_ids must be checked once it has ended."""

    batch_id: str
    verified: bool


class Adapter(Protocol):
    name: str
    max_requests: int
    max_bytes: int

    def route(self, method: str, url: str) -> Route | None:
        """Where a request to `url` (no query string) batches, or None if it cannot."""
        ...

    def account_headers(self, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """The request headers that name the account (and API version): queue key and batch
        calls both use them."""
        ...

    async def submit(
        self, http: ProviderHTTP, target: Target, items: list[tuple[str, dict[str, Any]]], tag: str
    ) -> str:
        """Create one batch of (custom_id, body) tagged with `tag`; its id."""
        ...

    async def find_orphans(
        self, http: ProviderHTTP, target: Target, tag: str, n: int, since: float
    ) -> list[Candidate]:
        """Batches that may have been created for `tag` (n requests, at `since` or later)."""
        ...

    async def poll(self, http: ProviderHTTP, target: Target, batch_id: str) -> Snapshot: ...

    async def results(self, http: ProviderHTTP, target: Target, snap: Snapshot) -> Results: ...

    async def cancel(self, http: ProviderHTTP, target: Target, batch_id: str) -> None: ...

    def dry_run_body(self, endpoint: str, body: dict[str, Any], custom_id: str) -> dict[str, Any]:
        """A response body the SDK parses into its usual type, with no provider I/O."""
        ...

    def sdk_error_base(self) -> type[Exception] | None:
        """The SDK's own error base class if that SDK wraps (and retries) any other exception
        its transport raises; our typed errors then also derive from it."""
        ...


def jsonl_lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in data.decode("utf-8").splitlines() if ln.strip()]


async def recent_batches(
    http: ProviderHTTP,
    target: Target,
    path: str,
    since: float,
    created_at: Callable[[dict[str, Any]], float],
    cursor: str,
) -> AsyncIterator[dict[str, Any]]:
    """The provider's batches, newest first, page by page, until a page reaches back past
    `since` (less the allowed clock skew) or there are no more."""
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = (await http.send("GET", target, path, params=params)).json()
        data = page.get("data") or []
        for b in data:
            yield b
        oldest = min((created_at(b) for b in data), default=0.0)
        if not page.get("has_more") or not data or oldest < since - CLOCK_SKEW_S:
            return
        params[cursor] = page.get("last_id") or data[-1]["id"]
