"""A batch's statuses (the OpenAI Batch API's), shared by the store, which guards every
transition with a compare-and-set, and the runner, which decides them."""

from __future__ import annotations

import enum


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ACTIVE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
TERMINAL = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED)
# Statuses a finalizer works on: results are frozen (only IN_PROGRESS accepts them).
CLOSING = (BatchStatus.FINALIZING, BatchStatus.CANCELLING)
