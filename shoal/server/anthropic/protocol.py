"""Anthropic request bodies. Unknown fields are accepted (and ignored) like on the OpenAI side;
known fields the engine cannot honour are refused with a 400 in `messages`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_BATCH_REQUESTS = 100_000


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Open):
    type: str
    text: str | None = None


class MessageParam(_Open):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class MessagesRequest(_Open):
    model: str
    max_tokens: int = Field(..., ge=1)
    messages: list[MessageParam] = Field(..., min_length=1)
    system: str | list[ContentBlock] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None


class BatchItem(_Open):
    custom_id: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]  # validated as MessagesRequest, stored as sent


class MessageBatchCreate(_Open):
    requests: list[BatchItem] = Field(..., min_length=1, max_length=MAX_BATCH_REQUESTS)
