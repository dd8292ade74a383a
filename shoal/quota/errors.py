"""Typed errors of the quota service, and the per-item error strings of its wire format.

Exceptions are for whole calls (a malformed batch, an unreachable service); a single item's
failure is never an exception but a machine-parseable string in its result, so one bad item
cannot fail its neighbours.
"""

from __future__ import annotations

from enum import StrEnum

from shoal.errors import InvalidRequestError, ShoalError


class ItemError(StrEnum):
    """`error` strings of reserve and complete results (`unknown_limit_key:<key>` and
    `exceeds_capacity:<key>` carry the key after a colon, with no space)."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_LIMIT_KEY = "unknown_limit_key"
    EXCEEDS_CAPACITY = "exceeds_capacity"
    LEASE_CONFLICT = "lease_conflict"
    LEASE_NOT_FOUND = "lease_not_found"
    LEASE_DENIED = "lease_denied"
    ALREADY_COMPLETED = "already_completed"
    BACKEND_ERROR = "backend_error"


class QuotaError(ShoalError):
    """Base class of the quota service's exceptions."""


class QuotaInvalidError(QuotaError, InvalidRequestError):
    """A malformed batch (empty, too many items), limit or configuration: nothing changed."""


class QuotaBackendError(QuotaError):
    """The store (SQLite file, Redis server) failed; no item of the batch was applied."""


class QuotaTransportError(QuotaError):
    """The quota service could not be reached or answered nonsense; safe to retry a reserve
    with the same lease id (leases are idempotent)."""


class QuotaExceededError(QuotaError):
    """A lease was still denied when the caller's wait budget ran out."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaItemError(QuotaError):
    """A reserve or complete the service refused for good (`code` is the result's error)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class QuotaClosedError(QuotaError):
    """The client or batcher was closed before the call."""
