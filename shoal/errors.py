"""Typed errors: callers catch these, the server maps them to OpenAI-style JSON errors."""


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""


class InvalidRequestError(ShoalError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling parameter, unknown id...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus what it asks to generate) can never fit the model or the KV pool."""


class PoolExhaustedError(ShoalError):
    """No KV blocks are left and nothing can be preempted to make room."""


class CacheCorruptionError(ShoalError):
    """A persisted KV cache file failed validation; callers discard it and recompute."""


class EngineClosedError(ShoalError):
    """The engine is shutting down and takes no new requests."""


class QueueFullError(ShoalError):
    """Too many requests are waiting; retry later."""
