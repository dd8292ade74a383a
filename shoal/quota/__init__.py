"""Shared budgets for jobs that call LLMs: reserve before a call, complete after it.

Limits (`rate` over a rolling window, or `concurrency`) live in a backend: SQLite on one
machine, Redis across machines. `QuotaService` applies design input 004's batch semantics;
`shoal.quota.http` serves them; `QuotaClient`/`AsyncQuotaClient` (with the `Batcher`) call
them in process or over HTTP. Nothing here imports torch or the engine.
"""

from shoal.quota.backend import QuotaBackend, open_backend
from shoal.quota.batcher import Batcher
from shoal.quota.client import AsyncQuotaClient, Lease, QuotaClient
from shoal.quota.errors import (
    ItemError,
    QuotaBackendError,
    QuotaClosedError,
    QuotaError,
    QuotaExceededError,
    QuotaInvalidError,
    QuotaItemError,
    QuotaTransportError,
)
from shoal.quota.limits import LeasePolicy, Limit, LimitKind, QuotaConfig, load_config
from shoal.quota.service import QuotaService
from shoal.quota.types import (
    Actual,
    CompleteRequest,
    CompleteResult,
    Requirement,
    ReserveRequest,
    ReserveResult,
    Usage,
    new_lease_id,
)

__all__ = [
    "Actual",
    "AsyncQuotaClient",
    "Batcher",
    "CompleteRequest",
    "CompleteResult",
    "ItemError",
    "Lease",
    "LeasePolicy",
    "Limit",
    "LimitKind",
    "QuotaBackend",
    "QuotaBackendError",
    "QuotaClient",
    "QuotaClosedError",
    "QuotaConfig",
    "QuotaError",
    "QuotaExceededError",
    "QuotaInvalidError",
    "QuotaItemError",
    "QuotaService",
    "QuotaTransportError",
    "Requirement",
    "ReserveRequest",
    "ReserveResult",
    "Usage",
    "load_config",
    "new_lease_id",
    "open_backend",
]
