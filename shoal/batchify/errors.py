"""Typed errors of `shoal.batchify`.

They are raised inside the intercepted SDK call, so they reach the caller as they are: the
SDKs wrap only httpx's own transport errors, and these are not httpx errors.
"""

from __future__ import annotations

from shoal.errors import ShoalError


class BatchifyError(ShoalError):
    """Base class of every error `shoal.batchify` raises on purpose."""


class BatchifyClosedError(BatchifyError):
    """A call was made through a scope that has already been closed."""


class BatchSubmitError(BatchifyError):
    """The provider refused the upload or the batch itself (not one request in it)."""


class BatchFailedError(BatchifyError):
    """The provider failed the whole batch (for example its input did not validate)."""


class BatchExpiredError(BatchifyError):
    """The request was not run before the batch's completion window ended."""


class BatchCancelledError(BatchifyError):
    """The batch was cancelled before this request ran."""


class BatchResultMissingError(BatchifyError):
    """The batch ended but holds no result (and no error) for this request."""


class ProviderHTTPError(BatchifyError):
    """A Files / Batches call kept failing after every retry, or failed with a 4xx."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
