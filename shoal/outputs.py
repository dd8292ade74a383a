"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """A snapshot of one request. `text` and `token_ids` are cumulative and only ever grow.

    `token_ids` holds the generated ids only (an EOS that ended the request included);
    `finish_reason` is None while running, then "stop", "length" or "abort".
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
