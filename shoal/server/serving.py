"""From a parsed request to engine calls and back: shared by the HTTP routes and batches.

Handlers stay thin: they parse, call `prepare_*`, then `respond` or `stream_sse`. No engine
logic lives here, only the translation between OpenAI fields and `SamplingParams`. `Serving`
is everything answering a request needs, so the batch runner uses exactly what routes use.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, cast

from shoal.engine.async_engine import AsyncEngine
from shoal.engine.pins import CachePin
from shoal.engine.protocol import EngineProtocol
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams, StructuredOutput
from shoal.server import formatting as fmt
from shoal.server.chat_prompt import chat_prompt
from shoal.server.errors import APIError, model_not_found, to_api_error
from shoal.server.ids import new_id
from shoal.server.metrics import ServerMetrics
from shoal.server.protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from shoal.server.schema_check import SchemaLimits, SchemaRefusal
from shoal.server.structured import ToolPlan, compiled, plan_answer
from shoal.server.tenancy import UNSALTED, KVScope, Tenant

Prompt = str | list[int]
PromptBuilder = Callable[[EngineProtocol, ChatCompletionRequest, ToolPlan | None], list[int]]


@dataclass(slots=True)
class Serving:
    """The engine (for its facts: model, tokenizer, limits), its async front, metrics, and
    the limits a request's JSON schemas must keep."""

    engine: EngineProtocol
    aeng: AsyncEngine
    metrics: ServerMetrics
    schema_limits: SchemaLimits = field(default_factory=SchemaLimits)

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)


@dataclass(slots=True)
class Prepared:
    """One request, ready for the engine: a prompt and params per choice."""

    chat: bool
    rid: str
    created: int
    model: str
    jobs: list[tuple[Prompt, SamplingParams]]
    n: int = 1  # choices per prompt; jobs are prompt-major
    include_usage: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolPlan | None = None  # how to read tool calls out of each answer
    grammar: Any = None  # the compiled constraint, held until the engine has its matchers
    kv: KVScope = UNSALTED  # whose KV each prompt may reuse (its tenant's, its cache_salt's)


def _check_common(srv: Serving, req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.model != srv.model_name:
        raise model_not_found(req.model)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported (use 0 or leave it out)", param=name)


def _params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    j: int,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    seed = req.seed
    if seed is not None and j:
        seed = (seed + j) % (2**63)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=seed,
        stop=req.stop,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        structured=structured,
    )


def _prepared(
    srv: Serving,
    req: CompletionRequest | ChatCompletionRequest,
    jobs: list[tuple[Prompt, SamplingParams]],
    *,
    n: int,
    priority: int,
    session_id: str | None,
    tenant: Tenant,
) -> Prepared:
    """The parts of `Prepared` both endpoints fill the same way: session ids and cache keys
    in the tenant's namespace, the tenant's KV scope."""
    chat = isinstance(req, ChatCompletionRequest)
    engine_kwargs: dict[str, Any] = {"priority": priority}
    sid = session_id or req.session_id  # the X-Session-Id header wins over the body
    if sid:
        engine_kwargs["session_id"] = tenant.scoped(sid)
    elif req.prompt_cache_key:  # a hint, not a session: no turn waits for another
        key = tenant.scoped(req.prompt_cache_key)
        engine_kwargs["cache_pins"] = (CachePin(f"key:openai:{key}"),)
    return Prepared(
        chat=chat,
        rid=new_id("chatcmpl-" if chat else "cmpl-"),
        created=int(time.time()),
        model=srv.model_name,
        jobs=jobs,
        n=n,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        engine_kwargs=engine_kwargs,
        kv=tenant.kv_scope(req.cache_salt),
    )


async def prepare_completion(
    srv: Serving,
    req: CompletionRequest,
    *,
    tenant: Tenant,
    priority: int = 0,
    session_id: str | None = None,
) -> Prepared:
    _check_common(srv, req)
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
    p = req.prompt
    prompts: list[Prompt]
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    max_tokens = req.max_tokens or 16
    params = [_params(req, max_tokens, req.logprobs, j) for j in range(n)]
    if any(isinstance(pr, str) for pr in prompts):  # tokenizing can take a while: off the loop
        prompts = await asyncio.to_thread(lambda: [srv.engine.encode(pr) for pr in prompts])
    jobs = [(pr, params[j]) for pr in prompts for j in range(n)]
    return _prepared(srv, req, jobs, n=n, priority=priority, session_id=session_id, tenant=tenant)


async def prepare_chat(
    srv: Serving,
    req: ChatCompletionRequest,
    *,
    tenant: Tenant,
    priority: int = 0,
    session_id: str | None = None,
    tool_schema_at: str = "tools.{}.function.parameters",
    prompt: PromptBuilder = chat_prompt,
) -> Prepared:
    """`tool_schema_at` names a tool's schema in errors, in the request's own API; `prompt`
    turns the messages into prompt ids (the Responses API continues a chain's tokens through
    its own)."""
    _check_common(srv, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    template = getattr(srv.engine.tokenizer, "chat_template", None)
    try:
        plan, structured = plan_answer(req, template, srv.schema_limits, tool_schema_at)
        # templating and tokenizing can take a while: off the loop
        ids = await asyncio.to_thread(prompt, srv.engine, req, plan)
        grammar = None if structured is None else await compiled(srv.engine, structured, plan)
    except SchemaRefusal as e:
        srv.metrics.schema_refusals.labels(reason=e.reason).inc()
        raise APIError(400, str(e), param=e.param) from e
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, srv.engine.max_model_len - len(ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    n = req.n or 1
    jobs: list[tuple[Prompt, SamplingParams]] = [
        (ids, _params(req, max_tokens, logprobs, j, structured)) for j in range(n)
    ]
    prep = _prepared(srv, req, jobs, n=n, priority=priority, session_id=session_id, tenant=tenant)
    prep.tools = plan
    prep.grammar = grammar
    return prep


async def _one(srv: Serving, prep: Prepared, i: int) -> AsyncGenerator[RequestOutput]:
    """One choice through the engine, with TTFT and inter-token latency recorded."""
    prompt, params = prep.jobs[i]
    request_id = f"{prep.rid}-{i // prep.n}-{i % prep.n}"
    metrics = srv.metrics
    last_t: float | None = None
    last_n = 0
    final: RequestOutput | None = None
    ids = prompt if isinstance(prompt, list) else []
    salt = prep.kv.salt_for(ids, srv.engine.config.block_size)
    kwargs = {**prep.engine_kwargs, "cache_salt": salt} if salt else prep.engine_kwargs
    try:
        gen = cast(
            AsyncGenerator[RequestOutput], srv.aeng.generate(prompt, params, request_id, **kwargs)
        )
        async with aclosing(gen):
            async for out in gen:
                now = time.monotonic()
                k = len(out.token_ids)
                if k > last_n:
                    if last_t is None:
                        first = out.metrics.get("first_token_time", now)
                        arrival = out.metrics.get("arrival_time", first)
                        metrics.ttft.observe(max(0.0, first - arrival))
                    else:
                        metrics.itl.observe((now - last_t) / (k - last_n))
                    last_t, last_n = now, k
                final = out
                yield out
    finally:
        metrics.finished(final)


async def merged(srv: Serving, prep: Prepared) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """All choices at once, tagged by index. Closing this aborts whatever still runs."""
    if len(prep.jobs) == 1:
        async with aclosing(_one(srv, prep, 0)) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with aclosing(_one(srv, prep, i)) as gen:
                async for out in gen:
                    queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prep.jobs))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def respond(srv: Serving, prep: Prepared) -> dict[str, Any]:
    """Run to completion and return the response body (raises APIError)."""
    finals: list[RequestOutput | None] = [None] * len(prep.jobs)
    try:
        async with aclosing(merged(srv, prep)) as gen:
            async for i, out in gen:
                finals[i] = out
    except Exception as e:
        raise to_api_error(e) from e
    outs = [o for o in finals if o is not None]
    if len(outs) != len(finals) or any(o.finish_reason == "abort" for o in outs):
        raise APIError(503, "the request was aborted (the server is shutting down)")
    if prep.chat:
        return fmt.chat_body(
            prep.rid, prep.created, prep.model, outs, prep.n, srv.engine.tokenizer, prep.tools
        )
    return fmt.completion_body(
        prep.rid, prep.created, prep.model, outs, prep.n, srv.engine.tokenizer
    )


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def start_stream(
    srv: Serving, prep: Prepared
) -> tuple[AsyncGenerator[tuple[int, RequestOutput]], tuple[int, RequestOutput]]:
    """Submit and wait for the first output, so that bad input fails before the 200."""
    gen = merged(srv, prep)
    try:
        first = await anext(gen)
    except StopAsyncIteration as e:
        await gen.aclose()
        raise APIError(503, "the request was aborted") from e
    except BaseException as e:
        await gen.aclose()
        raise to_api_error(e) from e
    return gen, first


async def stream_sse(
    srv: Serving,
    prep: Prepared,
    gen: AsyncGenerator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput],
) -> AsyncGenerator[bytes]:
    """Server-sent events in OpenAI's chunk format, ending with `[DONE]`."""
    tok = srv.engine.tokenizer
    k = len(prep.jobs)
    text_sent = [0] * k
    toks_sent = [0] * k
    finals: list[RequestOutput | None] = [None] * k
    wu = prep.include_usage
    chunk = fmt.chat_chunk if prep.chat else fmt.completion_chunk
    rid, created, model = prep.rid, prep.created, prep.model

    readers = [prep.tools.parser() if prep.tools else None for _ in range(k)]

    def choice(i: int, out: RequestOutput) -> dict[str, Any] | None:
        delta = out.text[text_sent[i] :]
        start, end = toks_sent[i], len(out.token_ids)
        if prep.chat:
            message, finish = fmt.chat_delta(readers[i], delta, out)
            if not message and not out.finished and (end == start or out.logprobs is None):
                text_sent[i] += len(delta)
                return None
            lp = fmt.chat_logprobs(tok, out, start, end) if end > start else None
            c: dict[str, Any] = {"index": i, "delta": message}
        else:
            if not delta and not out.finished and (end == start or out.logprobs is None):
                return None
            lp = fmt.completion_logprobs(tok, out, start, end, text_sent[i])
            c = {"index": i, "text": delta}
            finish = out.finish_reason
        c["logprobs"] = lp
        c["finish_reason"] = finish
        text_sent[i] += len(delta)
        toks_sent[i] = end
        return c

    try:
        if prep.chat:
            for i in range(k):
                role = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse(chunk(rid, created, model, role, wu))
        pending: list[tuple[int, RequestOutput]] = [first]
        while True:
            for i, out in pending:
                if out.finish_reason == "abort":
                    raise APIError(503, "the request was aborted (the server is shutting down)")
                if out.finished:
                    finals[i] = out
                c = choice(i, out)
                if c is not None:
                    yield _sse(chunk(rid, created, model, c, wu))
            try:
                pending = [await anext(gen)]
            except StopAsyncIteration:
                break
        if wu:
            yield _sse(
                {
                    "id": rid,
                    "object": chunk(rid, created, model, {}, wu)["object"],
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": fmt.usage(finals, prep.n),
                }
            )
    except Exception as e:
        yield _sse(to_api_error(e).body())
    finally:
        await gen.aclose()
    yield _sse("[DONE]")
