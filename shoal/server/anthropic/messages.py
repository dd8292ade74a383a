"""`POST /v1/messages`, and the same answer for a message batch line.

A Messages request becomes a chat request (system blocks first, text blocks joined, tool use
translated by `tools`) and runs through the shared `prepare_chat` / `respond` / `start_stream`
path: one engine path for both APIs. Streams use Anthropic's event types: message_start,
content_block_start, ping, content_block_delta (text_delta, or input_json_delta for a
tool_use block)..., content_block_stop, message_delta, message_stop.
`POST /v1/messages/count_tokens` builds the same prompt and counts it. Prompt caching
(`cache_control`, cache usage, Claude Code's billing line) is `caching`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from shoal.engine.pins import CachePin
from shoal.outputs import RequestOutput
from shoal.server.anthropic import caching
from shoal.server.anthropic import formatting as fmt
from shoal.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from shoal.server.anthropic.tools import chat_messages, tool_fields
from shoal.server.chat_prompt import chat_prompt
from shoal.server.errors import APIError, model_not_found, to_api_error
from shoal.server.formatting import tool_finish
from shoal.server.ids import new_id
from shoal.server.protocol import ChatCompletionRequest
from shoal.server.routes import SessionHeader, admit, metered
from shoal.server.serving import Prepared, Serving, prepare_chat, respond
from shoal.server.state import ServerState, get_state
from shoal.server.structured import plan_answer
from shoal.server.tenancy import Tenant, get_tenant
from shoal.tool_calls import ArgsDelta, CallStart, Event, TextDelta

router = APIRouter()
# Accepted and answered without thinking blocks (the models shoal runs do not think apart):
# Claude Code asks for it on every turn.
THINKING = ("disabled", "enabled", "adaptive")
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]
TOOL_SCHEMA = "tools.{}.input_schema"  # where errors place a tool's schema


def to_chat(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that answers `req` (raises APIError for what cannot be honoured)."""
    if req.thinking and req.thinking.get("type") not in THINKING:
        raise APIError(400, f"thinking.type must be one of {THINKING}", param="thinking")
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system
        if isinstance(system, list):  # system blocks are text; join them
            system = "".join(b.text or "" for b in system)
        messages.append({"role": "system", "content": system})
    messages += chat_messages(req.messages)
    body: dict[str, Any] = {"model": req.model, "messages": messages, **tool_fields(req)}
    if isinstance(req, MessagesRequest):
        body.update(
            cache_salt=req.cache_salt,
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop_sequences or None,
        )
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from e


Positions = list[tuple[int, float]]  # (tokens, TTL) of each cache_control breakpoint


async def prepare(
    srv: Serving,
    req: MessagesRequest,
    tenant: Tenant,
    priority: int = 0,
    session_id: str | None = None,
    keep_billing_header: bool = False,
) -> tuple[Prepared, Positions]:
    """The engine request for `req`, and where its cache breakpoints fall; the prefix up to
    each, and with `metadata.user_id` the whole conversation, are pinned in the KV store."""
    if not keep_billing_header:
        req = caching.strip_billing_header(req)
    found = caching.breakpoints(req)
    prep = await prepare_chat(
        srv,
        to_chat(req),
        tenant=tenant,
        priority=priority,
        session_id=session_id,
        tool_schema_at=TOOL_SCHEMA,
    )
    prep.rid = new_id("msg_")
    if prep.tools is not None:
        prep.tools = dataclasses.replace(prep.tools, id_prefix="toolu_")
    ids = prep.jobs[0][0]
    positions: Positions = []
    if found and isinstance(ids, list):
        positions = await asyncio.to_thread(_positions, srv, req, found, ids)
    pins = list(caching.cache_pins(positions))
    user = (req.metadata or {}).get("user_id")
    if isinstance(user, str) and user and session_id is None:  # a hint: kept like a session
        pins.append(CachePin(f"key:anthropic:{tenant.scoped(user)}"))
    if pins:
        prep.engine_kwargs["cache_pins"] = tuple(pins)
    return prep, positions


def _positions(
    srv: Serving, req: MessagesRequest, found: list[caching.Breakpoint], ids: list[int]
) -> Positions:
    template = getattr(srv.engine.tokenizer, "chat_template", None)
    out: Positions = []
    for bp in found:
        try:
            chat = to_chat(caching.truncated(req, bp))
            plan, _ = plan_answer(chat, template)
            out.append((caching.position(ids, chat_prompt(srv.engine, chat, plan)), bp[2]))
        except APIError:
            continue  # a cut that cannot be rendered alone caches nothing
    return out


async def answer(srv: Serving, prep: Prepared, positions: Positions) -> dict[str, Any]:
    chat = await respond(srv, prep)
    forced = prep.tools is not None and bool(prep.tools.forced)
    msg = fmt.message_from_chat(prep.rid, chat, forced)
    u = chat["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    msg["usage"] = caching.usage(u["prompt_tokens"], cached, u["completion_tokens"], positions)
    return msg


async def run_line(
    srv: Serving, body: dict[str, Any], priority: int, tenant: Tenant
) -> tuple[int, dict[str, Any], int, int]:
    """One message batch line: (status, Message or Anthropic error, input and output tokens)."""
    try:
        req = MessagesRequest.model_validate(body)
        prep, positions = await prepare(srv, req, tenant, priority)
        msg = await answer(srv, prep, positions)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        return 400, fmt.error_body(400, f"{where}: {first['msg']}"), 0, 0
    except Exception as e:
        err = to_api_error(e)
        return err.status, fmt.error_body(err.status, err.message), 0, 0
    usage = msg["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    return 200, msg, prompt + usage["cache_creation_input_tokens"], usage["output_tokens"]


class _Blocks:
    """Content blocks as stream events: text blocks and tool_use blocks with their
    `input_json_delta`s, each started when its first piece comes and stopped before the next."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or "tool_use"

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self.stop()
        self.index += 1
        self.open = block["type"]
        return [
            *events,
            fmt.sse({"type": "content_block_start", "index": self.index, "content_block": block}),
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return fmt.sse({"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [fmt.sse({"type": "content_block_stop", "index": self.index})]

    def on(self, event: Event) -> list[bytes]:
        if isinstance(event, TextDelta):
            start = [] if self.open == "text" else self._start({"type": "text", "text": ""})
            if not event.text:
                return start
            return [*start, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            return self._start(block)
        if isinstance(event, ArgsDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        return self.stop()  # CallEnd


async def stream_events(
    prep: Prepared,
    positions: Positions,
    gen: AsyncGenerator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput],
) -> AsyncGenerator[bytes]:
    out = first[1]
    start = fmt.message(prep.rid, prep.model, [], None, {})
    start["stop_reason"] = None
    prompt = len(out.prompt_token_ids)
    start["usage"] = caching.usage(prompt, out.num_cached_tokens, 0, positions)
    yield fmt.sse({"type": "message_start", "message": start})
    blocks = _Blocks()
    reader = prep.tools.parser() if prep.tools is not None else None
    if reader is None:  # plain text: its one block opens at once, as Anthropic's does
        for line in blocks.on(TextDelta("")):
            yield line
    yield fmt.sse({"type": "ping"})
    sent = 0
    try:
        while True:
            if out.finish_reason == "abort":
                raise APIError(503, "the request was aborted (the server is shutting down)")
            text, sent = out.text[sent:], len(out.text)
            events: list[Event] = [TextDelta(text)] if text else []
            if reader is not None:
                events = reader.feed(text) + (reader.finish() if out.finished else [])
            for event in events:
                for line in blocks.on(event):
                    yield line
            try:
                out = (await anext(gen))[1]
            except StopAsyncIteration:
                break
        forced = prep.tools is not None and bool(prep.tools.forced)
        if blocks.index < 0 and not forced:  # nothing was said: one empty text block
            for line in blocks.on(TextDelta("")):
                yield line
        for line in blocks.stop():
            yield line
        finish = out.finish_reason
        if reader is not None:
            finish = tool_finish(finish, reader.calls)
        yield fmt.sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": fmt.stop_reason(finish), "stop_sequence": None},
                "usage": {"output_tokens": len(out.token_ids)},
            }
        )
        yield fmt.sse({"type": "message_stop"})
    except Exception as e:
        err = to_api_error(e)
        yield fmt.sse(fmt.error_body(err.status, err.message))
    finally:
        await gen.aclose()


@router.post("/v1/messages/count_tokens")
async def count_tokens(state: State, req: CountTokensRequest) -> dict[str, int]:
    """The prompt's tokens, counted exactly as `POST /v1/messages` would build it, whatever
    its length (the body's byte limit bounds the work)."""
    srv = state.serving
    if not state.config.keep_billing_header:
        req = caching.strip_billing_header(req)
    chat = to_chat(req)
    if chat.model != srv.model_name:
        raise model_not_found(chat.model)
    template = getattr(srv.engine.tokenizer, "chat_template", None)
    plan, _ = plan_answer(chat, template, srv.schema_limits, TOOL_SCHEMA)
    ids = await asyncio.to_thread(chat_prompt, srv.engine, chat, plan, check_length=False)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def create_message(
    request: Request,
    state: State,
    tenant: Caller,
    req: MessagesRequest,
    x_session_id: SessionHeader = None,
) -> Response:
    """`X-Session-Id` makes the conversation a session, as on the OpenAI routes; `anthropic-
    beta` and `anthropic-version` headers are accepted and need nothing. With `--quota`, the
    request is admitted against its tenant's budget as chat requests are."""
    srv = state.serving
    keep = state.config.keep_billing_header
    prep, positions = await prepare(
        srv, req, tenant, session_id=x_session_id, keep_billing_header=keep
    )
    return await metered(
        request,
        await admit(request, state, tenant, prep),
        srv,
        prep,
        (lambda gen, first: stream_events(prep, positions, gen, first)) if req.stream else None,
        lambda: answer(srv, prep, positions),
        _used,
    )


def _used(message: dict[str, Any]) -> int:
    """The tokens a Message used (its input, cached or not, and its output)."""
    u = message["usage"]
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return sum(u[k] for k in parts) + u["output_tokens"]
