"""Reserving a batch against shared budgets (`shoal.quota`) before it is submitted.

A batch costs its requests and tokens at once, so it reserves them as one lease: the
`requirements` function maps the batch about to go out to quota requirements, the lease is
taken before the intent is written (waiting out denials up to `max_wait_s`), and it is
completed when the batch's results are in, reporting the tokens they really used against
`tokens_key`. A batch resumed or adopted after a crash was reserved by the run that created it;
that lease expires on its own.

The blocking `QuotaClient` is used, on worker threads: batchify's loop runs on its own thread,
where an async client made on the caller's loop could not be used.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.batchify.calls import Outcome
from shoal.batchify.errors import BatchSubmitError

if TYPE_CHECKING:  # shoal.quota is only needed by those who pass a policy
    from shoal.quota.client import Lease, QuotaClient
    from shoal.quota.types import Requirement


@dataclass(frozen=True, slots=True)
class BatchSpec:
    """The batch about to be submitted, as a requirements function sees it."""

    adapter: str  # "openai" or "anthropic"
    base_url: str
    endpoint: str
    model: str
    bodies: list[dict[str, Any]]


@dataclass(slots=True)
class QuotaPolicy:
    client: QuotaClient
    requirements: Callable[[BatchSpec], Sequence[Requirement]]
    tokens_key: str | None = None  # reported with the tokens the results used
    max_wait_s: float | None = None  # the client's own when None


def tokens_used(results: Iterable[object]) -> int:
    """Total tokens of the successful answers: OpenAI's `usage.total_tokens`, or Anthropic's
    input + output tokens."""
    total = 0
    for o in results:
        if not isinstance(o, Outcome) or o.status_code >= 400:
            continue
        try:
            usage = json.loads(o.body).get("usage") or {}
        except (ValueError, AttributeError):
            continue
        if "total_tokens" in usage:
            total += int(usage["total_tokens"])
        else:
            total += int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
    return total


class BatchLease:
    """One batch's lease, held from before its submission until its results are in."""

    def __init__(self, policy: QuotaPolicy, spec: BatchSpec, job_id: str) -> None:
        self.policy = policy
        self._cm: AbstractContextManager[Lease] = policy.client.lease(
            policy.requirements(spec), job_id=job_id, max_wait_s=policy.max_wait_s
        )
        self._lease: Lease | None = None

    async def acquire(self) -> None:
        """Reserve, waiting out denials; past `max_wait_s` (or when the quota service fails)
        the batch is not submitted and its callers get a `BatchSubmitError`."""
        try:
            self._lease = await asyncio.to_thread(self._cm.__enter__)
        except Exception as e:
            raise BatchSubmitError(f"quota not granted for the batch: {e}") from e

    async def release(self, results: Iterable[object] | None, *, submitted: bool = True) -> None:
        """Complete the lease: with the tokens the results used; as reserved when the batch
        failed as a whole (it still went to the provider); refunded when nothing was submitted."""
        if self._lease is None:
            return
        lease, self._lease = self._lease, None
        if not submitted:
            for r in lease.requirements:
                lease.report(r.key, 0)
        elif results is not None and self.policy.tokens_key is not None:
            lease.report(self.policy.tokens_key, tokens_used(results))
        await asyncio.to_thread(self._cm.__exit__, None, None, None)
