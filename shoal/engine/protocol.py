"""`EngineProtocol`: what `LLM`, `AsyncEngine` and the server use of an engine, and
`create_engine`, which picks the backend an `EngineConfig` names.

Both backends provide it: the torch `Engine` (`llm_engine.py`) and the MLX backend's
`MLXEngine` (`shoal/backends/mlx/adapter.py`). Callers typed against it never import either
backend's model stack; `create_engine` imports only the one asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol

from shoal.config import EngineConfig
from shoal.engine.block_pool import BlockPool
from shoal.engine.hashing import Salt
from shoal.engine.pins import CachePin
from shoal.engine.sessions import SessionInfo, SessionManager
from shoal.engine.stats import EngineStats
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams, StructuredOutput


class EngineProtocol(Protocol):
    config: EngineConfig
    model_name: str
    tokenizer: Any
    max_model_len: int
    pool: BlockPool
    sessions: SessionManager
    step_thread: threading.Thread | None  # the thread that runs `step` (an AsyncEngine's)

    # Any thread: validate (typed errors) and queue; abort by id.
    def encode(self, prompt: str | list[int]) -> list[int]: ...

    # check_length=False: any length (counting tokens is how a client learns it is too long).
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        check_length: bool = True,
    ) -> list[int]: ...

    # Start compiling a structured-output spec into the engine's cache without blocking: the
    # future holds the compiled grammar (keep it until add_request) or InvalidRequestError.
    def compile_structured(self, spec: StructuredOutput) -> Future[Any]: ...

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        session_id: str | None = None,
        cache_pins: Iterable[CachePin] = (),
        cache_salt: Salt | str | None = None,
    ) -> str: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    # The step thread: one iteration returns a snapshot of every request that moved.
    def step(self) -> list[RequestOutput]: ...

    def reset(self) -> list[RequestOutput]: ...

    def close(self) -> None: ...

    def save_sessions(self) -> int: ...

    def drop_session(self, session_id: str) -> bool: ...

    # Reads.
    def list_sessions(self) -> list[SessionInfo]: ...

    def session_info(self, session_id: str) -> SessionInfo | None: ...

    def stats(self) -> EngineStats: ...


def create_engine(config: EngineConfig) -> EngineProtocol:
    """The engine of `config.backend`, loaded."""
    if config.backend == "mlx":
        from shoal.backends.mlx.adapter import MLXEngine

        return MLXEngine(config)
    from shoal.engine.llm_engine import Engine

    return Engine(config)
