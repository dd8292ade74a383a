"""The Responses API on one server: a request becomes a chat request on the shared path
(`prepare_chat` with the chain's prompt builder), its answer becomes output items and events,
and a finished response is stored with what its chain's next response continues from.

A chain of responses is one engine session, named by the chain's first response id (every
later id in the chain starts with it, so a cluster routes the chain by the id alone). The
first response runs without a session (most responses are never continued; its full blocks
stay in the prefix cache); from the second on, each turn runs in the chain's session, which
keeps the turn's KV pinned while it runs, spills it when idle and restores it after a
restart, and `cached_tokens` is the engine's count of the prompt tokens it did not compute.
A response is its tenant's: another tenant can neither read, continue, cancel nor delete it
(404), and the chain's session is in the tenant's namespace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from shoal.outputs import RequestOutput
from shoal.server.errors import APIError, not_found, to_api_error
from shoal.server.ids import new_response_id
from shoal.server.responses.background import BackgroundTasks, EventLog, Running
from shoal.server.responses.events import Output, Sequenced
from shoal.server.responses.items import (
    Tools,
    chat_messages,
    chat_tool_choice,
    function_tools,
    normalize,
    response_format,
    to_chat,
)
from shoal.server.responses.output import Frame, status_of, usage
from shoal.server.responses.prompt import ChainPrompt, Turn
from shoal.server.responses.protocol import InputTokensRequest, ResponseCreateRequest
from shoal.server.serving import Prepared, Serving, merged, prepare_chat, start_stream
from shoal.server.store import Store
from shoal.server.store.responses import UNFINISHED, StoredResponse
from shoal.server.tenancy import Tenant

T = TypeVar("T")
Outputs = AsyncGenerator[tuple[int, RequestOutput]]
_TERMINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


@dataclass(slots=True)
class Pending:
    """A validated response, queued in the engine or about to be."""

    frame: Frame
    tenant: Tenant
    prep: Prepared
    prompt: ChainPrompt
    items: list[dict[str, Any]]  # the whole context's input items
    chain: str
    kept: bool  # the chain's session keeps this turn's KV
    namespaces: dict[str, str]
    dropped: list[str]  # tool types shoal cannot run, left out
    failure: APIError | None = None  # why the answer failed, when it did

    @property
    def req(self) -> ResponseCreateRequest:
        return self.frame.req


class Responses:
    def __init__(
        self, serving: Serving, store: Store, replica: str, keep: int, max_age_s: float
    ) -> None:
        self.serving = serving
        self.store = store
        self.replica = replica
        self.keep = keep
        self.max_age_s = max_age_s
        self.background = BackgroundTasks()

    async def _db(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kw)

    async def start(self) -> None:
        """Fail the background responses this replica was running when it stopped."""
        for r in await self._db(self.store.unfinished_responses, self.replica):
            error = {"code": "server_error", "message": "the server stopped before it finished"}
            obj = {**r.obj, "status": "failed", "error": error}
            await self._db(self.store.finish_response, r.id, obj)

    async def close(self) -> None:
        await self.background.close()

    async def get(self, response_id: str, tenant: Tenant) -> StoredResponse:
        found = await self._db(self.store.get_response, response_id, tenant=tenant.name)
        if found is None:
            raise not_found("response", response_id)
        return found

    # -- building the prompt -----------------------------------------------------------------
    async def _previous(self, response_id: str, tenant: Tenant) -> StoredResponse:
        prev = await self._db(self.store.get_response, response_id, tenant=tenant.name)
        if prev is None:
            raise not_found("response", response_id, param="previous_response_id")
        if prev.turn is None:
            raise APIError(
                400,
                f"response '{response_id}' is {prev.status}: only a completed or incomplete "
                "response can be continued",
                param="previous_response_id",
            )
        return prev

    async def _shape(
        self, req: InputTokensRequest, tenant: Tenant
    ) -> tuple[Any, ChainPrompt, list[dict[str, Any]], StoredResponse | None, Tools]:
        """(chat request, prompt builder, context items, previous response, tools)."""
        if req.conversation is not None:
            message = (
                "previous_response_id and conversation cannot be used together"
                if req.previous_response_id
                else "conversation is not supported: continue with previous_response_id"
            )
            raise APIError(400, message, param="conversation")
        previous_id = req.previous_response_id
        prev = await self._previous(previous_id, tenant) if previous_id else None
        tools = function_tools(req.tools)
        items = normalize(req.input)
        context = (prev.items + prev.obj["output"] if prev else []) + items
        messages = chat_messages(context)
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if not messages:
            raise APIError(400, "input must not be empty", param="input")
        choice = chat_tool_choice(req.tool_choice)
        if not tools.chat and choice in ("auto", "none"):  # every tool was dropped
            choice = None
        chat = to_chat(
            {
                "model": req.model,
                "messages": messages,
                "tools": tools.chat or None,
                "tool_choice": choice,
                "parallel_tool_calls": req.parallel_tool_calls,
                "response_format": response_format(req.text),
                "max_completion_tokens": getattr(req, "max_output_tokens", None),
                "temperature": getattr(req, "temperature", None),
                "top_p": getattr(req, "top_p", None),
                "cache_salt": getattr(req, "cache_salt", None),
            }
        )
        previous = Turn.from_json(prev.turn) if prev is not None and prev.turn else None
        return chat, ChainPrompt(previous, req.truncation == "auto"), context, prev, tools

    async def input_tokens(self, req: InputTokensRequest, tenant: Tenant) -> int:
        """The prompt's tokens, counted as `create` would build the prompt."""
        chat, prompt, *_ = await self._shape(req, tenant)
        prep = await prepare_chat(self.serving, chat, tenant=tenant, prompt=prompt)
        return len(prep.jobs[0][0])

    async def prepare(
        self, req: ResponseCreateRequest, tenant: Tenant, priority: int = 0, batch: bool = False
    ) -> Pending:
        """Validate and build the prompt (every 400 happens here, before anything runs)."""
        if req.background and req.store is False:
            raise APIError(400, "a background response must be stored (store=true)", param="store")
        if req.background and batch:
            raise APIError(400, "a batch line cannot run in the background", param="background")
        chat, prompt, context, prev, tools = await self._shape(req, tenant)
        rid = new_response_id(prev.chain if prev is not None else None)
        chain = prev.chain if prev is not None else rid
        kept = prev is not None and req.store is not False and not batch
        prep = await prepare_chat(
            self.serving,
            chat,
            tenant=tenant,
            priority=priority,
            session_id=chain if kept else None,
            prompt=prompt,
        )
        prep.rid = rid
        frame = Frame(rid, int(time.time()), self.serving.model_name, req, tools)
        return Pending(
            frame, tenant, prep, prompt, context, chain, kept, tools.namespaces, tools.dropped
        )

    # -- running -----------------------------------------------------------------------------
    async def _finish(
        self, p: Pending, obj: dict[str, Any], turn: Turn | None, seq: Sequenced
    ) -> None:
        if p.req.store is False:
            return
        turn_json = turn.as_json() if turn is not None else None
        if p.req.background:
            await self._db(
                self.store.finish_response, p.frame.id, obj, turn=turn_json, events=seq.kept
            )
            return
        record = StoredResponse(
            p.frame.id, p.chain, obj["status"], obj, p.items, turn_json, tenant=p.tenant.name
        )
        await self._db(self.store.add_response, record, keep=self.keep, max_age_s=self.max_age_s)

    async def events(
        self, p: Pending, gen: Outputs, first: RequestOutput | None, seq: Sequenced
    ) -> AsyncIterator[dict[str, Any]]:
        """The response's numbered events as its answer comes; it is stored when it ends.
        Closing this early (a client gone) aborts the answer and stores nothing, unless the
        response runs in the background (then it is stored as cancelled, or failed when the
        server is stopping)."""
        frame = p.frame
        output = Output(p.prep.tools, p.namespaces)
        start = "queued" if p.req.background else "in_progress"
        yield seq.number({"type": "response.created", "response": frame.response(start)})
        running = frame.response("in_progress")
        yield seq.number({"type": "response.in_progress", "response": running})
        out, sent = first, 0
        error: dict[str, Any] | None = None
        try:
            try:
                if out is None:
                    out = (await anext(gen))[1]
                while True:
                    if out.finish_reason == "abort":
                        raise APIError(503, "the request was aborted (the server is shutting down)")
                    for event in output.feed(out.text[sent:], out.finished):
                        yield seq.number(event)
                    sent = len(out.text)
                    try:
                        out = (await anext(gen))[1]
                    except StopAsyncIteration:
                        break
                status = status_of(out.finish_reason)
            except Exception as e:  # the answer failed: a failed response
                p.failure = to_api_error(e)
                status = "failed"
                error = {"code": p.failure.code or "server_error", "message": p.failure.message}
            for event in output.close(status):
                yield seq.number(event)
            assert out is not None or error is not None
            obj = frame.response(
                status, output.items, usage(out, p.kept) if out is not None else None, error
            )
            turn = None
            if status != "failed" and out is not None:
                ids = [*out.prompt_token_ids, *out.token_ids]
                turn = Turn(p.prompt.text, ids, len(out.prompt_token_ids))
            last = seq.number({"type": _TERMINAL_EVENT[status], "response": obj})
            await self._finish(p, obj, turn, seq)  # with its events, the last one included
            yield last
        except asyncio.CancelledError:
            if p.req.background:
                status = "failed" if self.background.closing else "cancelled"
                output.close("incomplete")
                obj = frame.response(status, output.items)
                if status == "failed":
                    obj["error"] = {"code": "server_error", "message": "the server stopped"}
                await self._finish(p, obj, None, seq)
            raise
        finally:
            await gen.aclose()

    async def respond(self, p: Pending) -> dict[str, Any]:
        """Run to the end; the final response object (raises APIError when it failed)."""
        gen, first = await start_stream(self.serving, p.prep)
        final: dict[str, Any] = {}
        async for event in self.events(p, gen, first[1], Sequenced()):
            final = event.get("response") or final
        if p.failure is not None:
            raise p.failure
        return final

    async def launch(self, p: Pending) -> Running:
        """Store a background response as queued and start it; its events go to a log."""
        queued = p.frame.response("queued")
        record = StoredResponse(
            p.frame.id, p.chain, "queued", queued, p.items, owner=self.replica, tenant=p.tenant.name
        )
        await self._db(self.store.add_response, record, keep=self.keep, max_age_s=self.max_age_s)
        running = Running(EventLog())
        self.background.add(p.frame.id, running)

        async def run() -> None:
            try:
                started = {**queued, "status": "in_progress"}
                await self._db(self.store.start_response, p.frame.id, started)
                gen = merged(self.serving, p.prep)
                async for event in self.events(p, gen, None, Sequenced(keep=True)):
                    await running.log.add(event)
            finally:
                await running.log.end()
                self.background.remove(p.frame.id)

        running.task = asyncio.create_task(run())
        return running

    async def run_line(self, body: dict[str, Any], priority: int, tenant: Tenant) -> dict[str, Any]:
        """One `/v1/responses` batch line's response (raises as the route would)."""
        req = ResponseCreateRequest.model_validate(body)
        return await self.respond(await self.prepare(req, tenant, priority, batch=True))

    # -- the stored side ---------------------------------------------------------------------
    async def cancel(self, response_id: str, tenant: Tenant) -> dict[str, Any]:
        found = await self.get(response_id, tenant)
        if not found.obj.get("background"):
            raise APIError(400, "only a background response can be cancelled")
        if found.status == "cancelled":
            return found.obj
        if found.status not in UNFINISHED:
            raise APIError(400, f"the response is {found.status} and cannot be cancelled")
        await self.background.stop(response_id)
        found = await self.get(response_id, tenant)
        if found.status in UNFINISHED:  # cancelled before it began, or not running here
            obj = {**found.obj, "status": "cancelled"}
            await self._db(self.store.finish_response, response_id, obj)
        return (await self.get(response_id, tenant)).obj

    async def delete(self, response_id: str, tenant: Tenant) -> None:
        chain = await self._db(self.store.delete_response, response_id, tenant=tenant.name)
        if chain is None:
            raise not_found("response", response_id)
        await self.background.stop(response_id)
        if not await self._db(self.store.chain_has_responses, chain):
            # nothing can continue the chain now
            await self.serving.aeng.drop_session(tenant.scoped(chain))
