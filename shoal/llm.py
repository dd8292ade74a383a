"""`LLM`: the offline, vLLM-shaped entry point over the engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from rich.progress import Progress

from shoal.config import EngineConfig
from shoal.engine.protocol import EngineProtocol, create_engine
from shoal.engine.sessions import SessionInfo
from shoal.engine.stats import EngineStats
from shoal.errors import InvalidRequestError
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]
SessionIds = str | Sequence[str | None] | None


class Sessions:
    """`llm.sessions`: list, inspect and drop agent sessions (in memory and on disk)."""

    def __init__(self, engine: EngineProtocol) -> None:
        self._engine = engine

    def list(self) -> list[SessionInfo]:
        """Most recently used first."""
        return self._engine.list_sessions()

    def __iter__(self) -> Iterator[SessionInfo]:
        return iter(self.list())

    def __len__(self) -> int:
        return len(self._engine.sessions)

    def __contains__(self, session_id: object) -> bool:
        return isinstance(session_id, str) and self.get(session_id) is not None

    def get(self, session_id: str) -> SessionInfo | None:
        return self._engine.session_info(session_id)

    def __getitem__(self, session_id: str) -> SessionInfo:
        info = self.get(session_id)
        if info is None:
            raise KeyError(session_id)
        return info

    def drop(self, session_id: str) -> bool:
        """Forget the session's KV everywhere; False if there was no such session."""
        return self._engine.drop_session(session_id)

    def clear(self) -> None:
        for info in self.list():
            self.drop(info.session_id)


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    `model=None` loads the bundled SmolLM2-135M-Instruct; otherwise an HF folder or a .gguf path.
    `backend="mlx"` runs it on the MLX backend (`pip install 'shoal[mlx]'`; .gguf files only).
    `cache_dir` keeps agent sessions' KV on disk across restarts; `close()` (or leaving a `with`
    block) saves what is unsaved. Other keywords are `EngineConfig` fields.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        backend: str = "torch",
        dtype: str = "float32",
        block_size: int = 16,
        cache_dir: str | None = None,
        **kw: Any,
    ) -> None:
        config = EngineConfig(
            model=model,
            backend=backend,
            dtype=dtype,
            block_size=block_size,
            cache_dir=cache_dir,
            **kw,
        )
        self.engine: EngineProtocol = create_engine(config)
        self.sessions = Sessions(self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        session_id: SessionIds = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        `session_id` (one for all prompts, or one per prompt) lets each turn reuse the KV its
        session kept from the previous one: pass the whole conversation as the prompt.
        `cache_salt` keeps these prompts' cached KV apart from everyone else's: only requests
        with the same salt share prefix blocks (vLLM's `cache_salt`).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompt_list = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise InvalidRequestError("give one SamplingParams, or one per prompt")
        if session_id is None or isinstance(session_id, str):
            session_list = [session_id] * len(prompt_list)
        else:
            session_list = list(session_id)
            if len(session_list) != len(prompt_list):
                raise InvalidRequestError("give one session_id, or one per prompt")
        return self._run(prompt_list, param_list, use_tqdm, session_list, cache_salt)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool | None = None,
        session_id: SessionIds = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(
            prompts, params, use_tqdm=use_tqdm, session_id=session_id, cache_salt=cache_salt
        )

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return self.engine.apply_chat_template(messages)

    def _run(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        use_tqdm: bool | None,
        session_ids: list[str | None],
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [
            engine.add_request(p, sp, session_id=sid, cache_salt=cache_salt)
            for p, sp, sid in zip(prompts, params, session_ids, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(ids) >= 8
        with Progress(disable=not show, transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            try:
                while len(results) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            progress.advance(task)
            except BaseException:
                for request_id in ids:
                    engine.abort(request_id)
                engine.step()
                raise
        return [results[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
