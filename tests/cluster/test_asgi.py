"""`AsgiHost` runs the `shoal serve` app without an HTTP server, as a replica does: lifespan,
answers as a head and body chunks (SSE streamed chunk by chunk), an early close aborts the
request's engine work, and shutdown releases the data dir."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from shoal.cluster.asgi import AsgiHost, Forwarded, ResponseHead
from shoal.config import EngineConfig
from shoal.server.app import create_app
from shoal.server.datadir import DataDirLock
from shoal.server.state import ServerConfig


def post(path: str, body: dict[str, object]) -> Forwarded:
    headers = [(b"content-type", b"application/json")]
    return Forwarded("POST", path, b"", headers, json.dumps(body).encode())


async def answer(host: AsgiHost, request: Forwarded) -> tuple[ResponseHead, list[bytes]]:
    parts = [part async for part in host.serve(request)]
    head, *chunks = parts
    assert isinstance(head, ResponseHead)
    return head, [c for c in chunks if isinstance(c, bytes)]


async def test_the_server_app_answers_in_process(tiny_chat_model: Path, tmp_path: Path) -> None:
    engine = EngineConfig(model=str(tiny_chat_model), num_blocks=256)
    app = create_app(ServerConfig(engine=engine, data_dir=tmp_path))
    host = AsgiHost(app)
    await host.start()
    try:
        head, body = await answer(host, Forwarded("GET", "/health"))
        assert head.status == 200 and json.loads(b"".join(body))["status"] == "ok"
        model = json.loads(b"".join((await answer(host, Forwarded("GET", "/v1/models")))[1]))
        name = model["data"][0]["id"]
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        head, body = await answer(host, post("/v1/chat/completions", chat))
        assert head.status == 200 and json.loads(b"".join(body))["usage"]["completion_tokens"]
        head, body = await answer(host, post("/v1/chat/completions", {**chat, "model": "x"}))
        assert head.status == 404 and json.loads(b"".join(body))["error"]["code"]
        stream = {**chat, "stream": True, "max_tokens": 6, "ignore_eos": True}
        head, body = await answer(host, post("/v1/chat/completions", stream))
        assert dict(head.headers)[b"content-type"].startswith(b"text/event-stream")
        assert len(body) > 3 and body[-1].strip() == b"data: [DONE]"  # chunk by chunk

        long = {**stream, "max_tokens": 400}
        parts = host.serve(post("/v1/chat/completions", long))
        assert isinstance(await anext(parts), ResponseHead)
        await anext(parts)  # the first token arrived; the client goes away
        await parts.aclose()
        state = app.state.shoal
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pool = state.engine.pool
            if not state.engine.has_unfinished_requests() and pool.num_free == pool.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert not state.engine.has_unfinished_requests()  # the abort reached the engine
        assert state.engine.pool.num_free == state.engine.pool.num_blocks
    finally:
        await host.stop()
    lock = DataDirLock(tmp_path)
    lock.acquire()  # shutdown ran: the data dir is free
    lock.release()
