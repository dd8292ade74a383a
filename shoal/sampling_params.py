"""Per-request generation settings, shaped like vLLM's so users feel at home."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a constrained request's output must match: set exactly one field.

    `json`: a JSON schema (a dict or its text); `json_object`: any JSON object; `regex`; `choice`:
    one of these strings; `grammar`: an EBNF grammar (xgrammar's dialect, GBNF-like, rule
    `root`); `structural_tag`: an xgrammar structural tag (how forced tool calls are built).
    The engine compiles each distinct spec once (see `key`) and masks every token the spec
    cannot continue with, so the output always parses; a request that runs out of
    `max_tokens` first ends with finish reason "length".
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "structural_tag")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output takes exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag (got {', '.join(given) or 'none'})"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict | str):
                raise InvalidRequestError(f"{name} must be a JSON object or its text")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a compiled grammar is cached under. Dicts keep their key
        order (a schema's property order is the order the output follows)."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", jsonlib.dumps(list(self.choice))
        for name in ("json", "structural_tag", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                text = value if isinstance(value, str) else jsonlib.dumps(value)
                return name, text
        raise AssertionError("validated in __post_init__")


_GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `logprobs=None` returns none; `logprobs=k` returns the
    chosen token's log-probability plus the `k` most likely alternatives at each step (from
    the model's own distribution, before a `structured` constraint masks it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise bad("structured must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy: dividing logits by them overflows (as vLLM
        treats anything below 1e-5)."""
        return self.temperature < _GREEDY_BELOW

    @property
    def stop_strings(self) -> list[str]:
        return self.stop if isinstance(self.stop, list) else []
