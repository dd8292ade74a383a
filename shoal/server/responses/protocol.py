"""Responses API request bodies, shaped like the `openai` SDK's `ResponseCreateParams`.

As on the other routes, unknown fields are accepted and ignored; the bounds reject what is
plainly invalid (a 400) before anything is queued. Input items are told apart by `type` (a
`message` may leave it out and give only `role`); tools stay plain objects here, since a
client may send tool types shoal cannot run, which are dropped (`items.tools`) rather than
refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from shoal.server.protocol import MAX_TOOLS, TOOL_NAME


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Body):
    """Accepted and carried in the chain's items; not shown to the model (a reasoning
    model's template renders its own thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type")
        return str(kind) if kind is not None else ("message" if "role" in value else None)
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="an input item's type must be one of message, function_call, "
        "function_call_output, reasoning",
    ),
]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=TOOL_NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class InputTokensRequest(_Body):
    """What shapes the prompt: `POST /v1/responses/input_tokens` takes just these."""

    model: str
    input: str | list[InputItem] = ""
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=512)
    conversation: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"


class ResponseCreateRequest(InputTokensRequest):
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = True
    background: bool | None = False
    stream: bool | None = False
    include: list[str] | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM's, as on chat
    reasoning: dict[str, Any] | None = None
    user: str | None = None
