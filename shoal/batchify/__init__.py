"""`shoal.batchify`: official SDK calls travel as provider Batch API jobs, crash-safe.

    async with batchify(batch_size=500, window_s=2.0) as b:
        replies = await asyncio.gather(*(client.chat.completions.create(...) for ...))

Importable without torch: nothing here imports the engine.
"""

from shoal.batchify.budget import BatchSpec, QuotaPolicy
from shoal.batchify.errors import (
    BatchCancelledError,
    BatchExpiredError,
    BatchFailedError,
    BatchifyClosedError,
    BatchifyError,
    BatchResultMissingError,
    BatchSubmitError,
    ProviderHTTPError,
)
from shoal.batchify.scope import Batchify, batchify, current_scope

__all__ = [
    "BatchCancelledError",
    "BatchExpiredError",
    "BatchFailedError",
    "BatchResultMissingError",
    "BatchSpec",
    "BatchSubmitError",
    "Batchify",
    "BatchifyClosedError",
    "BatchifyError",
    "ProviderHTTPError",
    "QuotaPolicy",
    "batchify",
    "current_scope",
]
