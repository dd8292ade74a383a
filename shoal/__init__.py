"""shoal: many small LLM requests travel together.

Public names load on first use, so `import shoal.batchify`, `import shoal.quota` and the
torch-free engine modules (scheduler, block pool, hashing, sessions) work on machines without
torch: only touching `shoal.LLM` or `shoal.Engine` imports the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shoal.errors import (
    CacheCorruptionError,
    EngineClosedError,
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
    QueueFullError,
    ShoalError,
)

if TYPE_CHECKING:
    from shoal.config import EngineConfig
    from shoal.engine.async_engine import AsyncEngine
    from shoal.engine.llm_engine import Engine
    from shoal.engine.stats import EngineStats
    from shoal.llm import LLM
    from shoal.outputs import RequestOutput
    from shoal.sampling_params import SamplingParams

_LAZY = {
    "LLM": "shoal.llm",
    "AsyncEngine": "shoal.engine.async_engine",
    "Engine": "shoal.engine.llm_engine",
    "EngineConfig": "shoal.config",
    "EngineStats": "shoal.engine.stats",
    "RequestOutput": "shoal.outputs",
    "SamplingParams": "shoal.sampling_params",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "CacheCorruptionError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "InvalidRequestError",
    "PoolExhaustedError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "ShoalError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
