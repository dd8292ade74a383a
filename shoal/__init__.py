"""shoal: many small LLM requests travel together."""

from shoal.config import EngineConfig
from shoal.engine.async_engine import AsyncEngine
from shoal.engine.llm_engine import Engine, EngineStats
from shoal.errors import (
    CacheCorruptionError,
    EngineClosedError,
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
    QueueFullError,
    ShoalError,
)
from shoal.llm import LLM
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams

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
