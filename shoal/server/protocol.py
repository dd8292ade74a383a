"""Request bodies, shaped like OpenAI's.

Unknown fields are accepted and ignored, so clients written for OpenAI (which send fields
shoal does not implement) keep working; the bounds here reject what is plainly invalid (a
400) before anything reaches the engine. Known fields the engine cannot honour are refused
with a clear 400 in `serving`, not silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16
MAX_PROMPTS = 64


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False


class _Sampling(_Request):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    session_id: str | None = Field(None, min_length=1, max_length=256)
    # Extensions (vLLM-style): accepted by shoal, ignored by OpenAI.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool | None = False


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, a list of strings, token ids, or lists of token ids."
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class BatchCreateRequest(_Request):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)
