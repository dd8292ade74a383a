"""A response's prompt: the chat template's rendering, continued token for token from the
previous response of its chain where the rendering allows.

The engine reuses a session's KV for the longest common *token* prefix of what the session
holds (the previous turn's prompt and output) and the new prompt. Re-tokenizing the whole
conversation can split the previous answer's text into other tokens than the model
generated, and the reuse would stop there. So when the template's text of the new
conversation starts with the previous prompt's text followed by the previous output's text,
the new prompt is the previous turn's token ids followed by the tokens of the rest: only the
new items are computed. Otherwise (a template that rewrites earlier turns, new
instructions or tools, a tool call the template renders differently from how the model wrote
it) the whole text is tokenized and the engine still reuses the common prefix.

`truncation: auto` drops the oldest exchanges (after the system messages) until the prompt
fits the model; `disabled` leaves a prompt that is too long to be refused with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.engine.protocol import EngineProtocol
from shoal.errors import InvalidRequestError
from shoal.server.chat_prompt import template_errors, template_input
from shoal.server.errors import APIError
from shoal.server.protocol import ChatCompletionRequest
from shoal.server.structured import ToolPlan


@dataclass(slots=True)
class Turn:
    """What a finished response leaves for the next one in its chain (stored with it)."""

    prompt_text: str
    token_ids: list[int]  # the prompt's, then the output's
    num_prompt_tokens: int

    def as_json(self) -> dict[str, Any]:
        return {
            "prompt_text": self.prompt_text,
            "token_ids": self.token_ids,
            "num_prompt_tokens": self.num_prompt_tokens,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Turn:
        text, ids, n = data["prompt_text"], data["token_ids"], data["num_prompt_tokens"]
        return cls(str(text), list(ids), int(n))


def render_text(engine: EngineProtocol, messages: list[dict[str, Any]], tools: Any) -> str:
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise InvalidRequestError("this model has no chat template")
    extra = {"tools": tools} if tools else {}
    return str(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    )


def _continued(engine: EngineProtocol, previous: Turn, text: str) -> list[int] | None:
    output = previous.token_ids[previous.num_prompt_tokens :]
    head = previous.prompt_text + engine.tokenizer.decode(output, skip_special_tokens=False)
    if not text.startswith(head):
        return None
    return previous.token_ids + engine.encode(text[len(head) :])


def _without_oldest_exchange(req: ChatCompletionRequest) -> ChatCompletionRequest | None:
    """`req` less its first exchange after the system messages: from the first other message
    up to the next user message. None when only the last exchange is left."""
    msgs = req.messages
    first = next((i for i, m in enumerate(msgs) if m.role not in ("system", "developer")), None)
    if first is None:
        return None
    end = next((j for j in range(first + 1, len(msgs)) if msgs[j].role == "user"), None)
    if end is None:
        return None
    return req.model_copy(update={"messages": msgs[:first] + msgs[end:]})


class ChainPrompt:
    """The prompt builder `prepare_chat` calls (in a worker thread); it keeps the text it
    rendered, which the response's `Turn` stores."""

    def __init__(self, previous: Turn | None, truncate: bool) -> None:
        self.previous = previous
        self.truncate = truncate
        self.text = ""
        self.continued = False  # the ids extend the previous turn's

    def __call__(
        self, engine: EngineProtocol, req: ChatCompletionRequest, plan: ToolPlan | None
    ) -> list[int]:
        while True:
            shorter = _without_oldest_exchange(req) if self.truncate else None
            messages, tools = template_input(engine, req, plan)
            try:
                with template_errors():
                    text = render_text(engine, messages, tools)
                    continued = _continued(engine, self.previous, text) if self.previous else None
                    ids = continued or engine.encode(text)
            except APIError as e:
                if shorter is None or e.code != "context_length_exceeded":
                    raise
                req = shorter
                continue
            if len(ids) < engine.max_model_len or shorter is None:
                self.text, self.continued = text, continued is not None
                return ids
            req = shorter
