"""`POST /v1/messages`, and the same answer for a message batch line.

A Messages request becomes a chat request (system blocks first, text blocks joined) and runs
through the shared `prepare_chat` / `respond` / `start_stream` path: one engine path for both
APIs. Streams use Anthropic's event types: message_start, content_block_start, ping,
content_block_delta..., content_block_stop, message_delta, message_stop.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from shoal.outputs import RequestOutput
from shoal.server.anthropic import formatting as fmt
from shoal.server.anthropic.protocol import ContentBlock, MessagesRequest
from shoal.server.errors import APIError, to_api_error
from shoal.server.ids import new_id
from shoal.server.protocol import ChatCompletionRequest
from shoal.server.routes import SessionHeader, SSEResponse, unless_disconnected
from shoal.server.serving import Prepared, Serving, prepare_chat, respond, start_stream
from shoal.server.state import ServerState, get_state

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]


def _content(content: str | list[ContentBlock]) -> str | list[dict[str, Any]]:
    return content if isinstance(content, str) else [b.model_dump() for b in content]


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req` (raises APIError for what cannot be honoured)."""
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.thinking and req.thinking.get("type") != "disabled":
        raise APIError(400, "extended thinking is not supported", param="thinking")
    messages: list[dict[str, Any]] = []
    if req.system:
        system = _content(req.system)
        if isinstance(system, list):  # system blocks are text; join them
            system = "".join(str(b.get("text") or "") for b in system)
        messages.append({"role": "system", "content": system})
    messages += [{"role": m.role, "content": _content(m.content)} for m in req.messages]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences or None,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from e


async def prepare(
    srv: Serving, req: MessagesRequest, priority: int = 0, session_id: str | None = None
) -> Prepared:
    prep = await prepare_chat(srv, to_chat(req), priority=priority, session_id=session_id)
    prep.rid = new_id("msg_")
    return prep


async def answer(srv: Serving, prep: Prepared) -> dict[str, Any]:
    return fmt.message_from_chat(prep.rid, await respond(srv, prep))


async def run_line(
    srv: Serving, body: dict[str, Any], priority: int
) -> tuple[int, dict[str, Any], int, int]:
    """One message batch line: (status, Message or Anthropic error, input and output tokens)."""
    try:
        msg = await answer(srv, await prepare(srv, MessagesRequest.model_validate(body), priority))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        return 400, fmt.error_body(400, f"{where}: {first['msg']}"), 0, 0
    except Exception as e:
        err = to_api_error(e)
        return err.status, fmt.error_body(err.status, err.message), 0, 0
    usage = msg["usage"]
    return 200, msg, usage["input_tokens"], usage["output_tokens"]


async def stream_events(
    prep: Prepared,
    gen: AsyncGenerator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput],
) -> AsyncIterator[bytes]:
    out = first[1]
    start = fmt.message(prep.rid, prep.model, "", None, {})
    start.update(content=[], stop_reason=None)
    start["usage"] = {"input_tokens": len(out.prompt_token_ids), "output_tokens": 0}
    yield fmt.sse({"type": "message_start", "message": start})
    yield fmt.sse(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    )
    yield fmt.sse({"type": "ping"})
    sent = 0
    try:
        while True:
            if out.finish_reason == "abort":
                raise APIError(503, "the request was aborted (the server is shutting down)")
            if len(out.text) > sent:
                delta = {"type": "text_delta", "text": out.text[sent:]}
                yield fmt.sse({"type": "content_block_delta", "index": 0, "delta": delta})
                sent = len(out.text)
            try:
                out = (await anext(gen))[1]
            except StopAsyncIteration:
                break
        stop = fmt.STOP_REASONS.get(out.finish_reason or "stop", "end_turn")
        yield fmt.sse({"type": "content_block_stop", "index": 0})
        yield fmt.sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": len(out.token_ids)},
            }
        )
        yield fmt.sse({"type": "message_stop"})
    except Exception as e:
        err = to_api_error(e)
        yield fmt.sse(fmt.error_body(err.status, err.message))
    finally:
        await gen.aclose()


@router.post("/v1/messages")
async def create_message(
    request: Request, state: State, req: MessagesRequest, x_session_id: SessionHeader = None
) -> Response:
    """`X-Session-Id` makes the conversation a session, as on the OpenAI routes."""
    srv = state.serving
    prep = await prepare(srv, req, session_id=x_session_id)
    if req.stream:
        gen, first = await start_stream(srv, prep)
        return SSEResponse(
            stream_events(prep, gen, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await unless_disconnected(request, answer(srv, prep))
    if body is None:
        return Response(status_code=499)
    return JSONResponse(body)
