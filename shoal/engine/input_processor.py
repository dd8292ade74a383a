"""From a caller's prompt and parameters to a `Sequence`, or a typed error.

Runs in the caller's thread, before anything is queued, so bad input fails where the caller
can see it and the step loop only ever meets valid requests.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from shoal.engine.block_pool import cdiv
from shoal.engine.hashing import Salt
from shoal.engine.sequence import Sequence
from shoal.errors import InvalidRequestError, PromptTooLongError
from shoal.sampling_params import SamplingParams, StructuredOutput

MAX_SESSION_ID_LEN = 256


def check_session_id(session_id: object) -> str:
    """The one rule for session ids, wherever they come from (argument, body, header)."""
    if not isinstance(session_id, str) or not session_id:
        raise InvalidRequestError("session_id must be a non-empty string")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidRequestError(f"session_id holds at most {MAX_SESSION_ID_LEN} characters")
    return session_id


def as_salt(cache_salt: Salt | str | None) -> Salt | None:
    """A request's salt: a `Salt`, or a text (vLLM's `cache_salt`) made into one."""
    if cache_salt is None or isinstance(cache_salt, Salt):
        return cache_salt
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string")
    return Salt.of(cache_salt)


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token covers: a prompt longer than
    `max_model_len` times this is too long whatever its tokens, so it is refused before the
    (possibly seconds-long) tokenization of a huge text. Vocabulary strings are at least as
    long as what they decode to (byte-level and SentencePiece markers only add bytes)."""
    return max((len(t.encode()) for t in tokenizer.get_vocab()), default=1)


class GrammarSource(Protocol):
    """What makes a constrained request's matcher (`engine/structured.Grammars`)."""

    def submit(self, spec: StructuredOutput) -> Future[Any]: ...

    def state_for(self, spec: StructuredOutput) -> Any: ...

    def close(self) -> None: ...


class InputProcessor:
    """`seeded(seed)` makes a seeded request's random state in its backend's terms (a
    `torch.Generator`, an MLX key); it lands in `Sequence.generator`. `grammars` compiles
    structured-output constraints; a backend without one refuses them."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        seeded: Callable[[int], Any],
        grammars: GrammarSource | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seeded = seeded
        self.grammars = grammars
        self._ids = itertools.count()
        self.max_prompt_bytes = (
            max_model_len * longest_token_bytes(tokenizer) if tokenizer is not None else 0
        )

    def check_text_length(self, num_bytes: int) -> None:
        """Refuse, without tokenizing, a text that cannot fit the model whatever its tokens."""
        if num_bytes > self.max_prompt_bytes:
            raise PromptTooLongError(
                f"the prompt is {num_bytes} bytes long, more than {self.max_model_len} tokens "
                f"of this model can hold (the model takes at most {self.max_model_len} tokens)"
            )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            self.check_text_length(len(prompt.encode()))
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = list(prompt)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        check_length: bool = True,
    ) -> list[int]:
        """The prompt ids for a conversation, ending where the assistant's reply begins.

        `tools` (OpenAI-shaped function tools) go to a template that renders them itself.
        Raises `InvalidRequestError` when the model has no tokenizer or no chat template; an
        error the template itself raises (a conversation it rejects) propagates unchanged.
        `check_length=False` takes a conversation of any length (to count its tokens).
        """
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        if check_length:
            size = sum(len(str(m.get("content") or "").encode()) for m in messages)
            self.check_text_length(size + (len(json.dumps(tools).encode()) if tools else 0))
        extra = {"tools": tools} if tools else {}
        text = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
        if check_length:
            return self.encode(text)
        return list(tok.encode(text, add_special_tokens=False))

    def _grammars(self) -> GrammarSource:
        if self.grammars is None:
            raise InvalidRequestError(
                "structured outputs are not supported on this backend (use backend='torch')"
            )
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a model with a tokenizer")
        return self.grammars

    def compile_structured(self, spec: StructuredOutput) -> Future[Any]:
        """Start compiling `spec` into the grammar cache (raises `InvalidRequestError` at once
        where there are no grammars): a caller whose thread must not wait awaits the future,
        and keeps its grammar, before `process`."""
        return self._grammars().submit(spec)

    def process(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        session_id: str | None,
        cache_salt: Salt | str | None = None,
    ) -> Sequence:
        if session_id is not None:
            check_session_id(session_id)
        salt = as_salt(cache_salt)
        params = params or SamplingParams()
        params.validate()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} so that one can be generated"
            )
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks:
            raise PromptTooLongError(
                f"{longest} tokens need {cdiv(longest, self.block_size)} KV blocks but the pool "
                f"has {self.num_blocks}: lower max_tokens or grow kv_cache_bytes"
            )
        seq = Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            priority=priority,
            session_id=session_id,
            prompt=prompt if isinstance(prompt, str) else None,
            salt=salt,
        )
        if params.seed is not None:
            seq.generator = self.seeded(params.seed)
        if params.structured is not None:
            seq.grammar = self._grammars().state_for(params.structured)
        return seq
