"""Anthropic request bodies. Unknown fields are accepted (and ignored) like on the OpenAI side;
known fields the engine cannot honour are refused with a 400 in `messages`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_BATCH_REQUESTS = 100_000


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Open):
    """text, tool_use (assistant) or tool_result (user); other types are refused."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class MessageParam(_Open):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("role", mode="before")
    @classmethod
    def _user_unless_assistant(cls, role: Any) -> Any:
        """Claude Code sends context turns under roles of its own; they are the user's (as
        vLLM reads them)."""
        return role if role == "assistant" or not isinstance(role, str) else "user"


class ToolParam(_Open):
    """A client tool; server tools (a `type` other than custom) are refused."""

    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of client tools
    type: str | None = None
    strict: bool | None = None  # only keywords the grammar enforces (else a 400)


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class Prompt(_Open):
    """What a prompt is built from, besides the model and the messages."""

    system: str | list[ContentBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(Prompt):
    """`POST /v1/messages/count_tokens`: what a Messages request's prompt holds."""

    model: str
    messages: list[MessageParam] = Field(..., min_length=1)


class MessagesRequest(Prompt):
    model: str
    max_tokens: int = Field(..., ge=1)
    messages: list[MessageParam] = Field(..., min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # as on OpenAI's routes


class BatchItem(_Open):
    custom_id: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]  # validated as MessagesRequest, stored as sent


class MessageBatchCreate(_Open):
    requests: list[BatchItem] = Field(..., min_length=1, max_length=MAX_BATCH_REQUESTS)
