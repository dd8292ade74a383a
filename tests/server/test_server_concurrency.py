"""128 concurrent streaming clients, a tenth of them leaving mid-stream: the rest complete,
every departure aborts its request, and the KV pool is whole afterwards."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
from server_harness import LiveServer, wait_pool_whole

CLIENTS = 128
MAX_TOKENS = 24
# Leavers ask for far more, so none can finish before the server notices it left (a loaded
# machine may take a while to), which would end it as "length" instead of an abort.
LEAVER_MAX_TOKENS = 400


def _aborts(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(r'^shoal_requests_total\{finish_reason="abort"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_aborts(server: LiveServer, at_least: float, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _aborts(server) >= at_least:
            return True
        time.sleep(0.05)
    return False


async def _client(http: httpx.AsyncClient, server: LiveServer, i: int) -> str:
    leave = i % 10 == 0
    body = {
        "model": server.model,
        "stream": True,
        "max_tokens": LEAVER_MAX_TOKENS if leave else MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "messages": [{"role": "user", "content": f"client {i}: tell a story"}],
    }
    chunks = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return "done"
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks += 1
            if leave and chunks == 3:
                return "left"  # closing the stream drops the connection mid-response
    return "truncated"


def test_many_streams_with_disconnects(server: LiveServer) -> None:
    aborts_before = _aborts(server)

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_client(http, server, i) for i in range(CLIENTS)))

    results = asyncio.run(main())
    leavers = sum(1 for i in range(CLIENTS) if i % 10 == 0)
    assert results.count("left") == leavers
    assert results.count("done") == CLIENTS - leavers
    assert _wait_aborts(server, aborts_before + leavers)
    assert wait_pool_whole(server)


def test_non_streaming_disconnect_aborts(server: LiveServer) -> None:
    aborts_before = _aborts(server)
    body = json.dumps(
        {"model": server.model, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 60
        while not server.state.engine.has_unfinished_requests():  # wait until it runs
            assert time.monotonic() < deadline
            time.sleep(0.005)
    # the client has gone while its request was generating
    assert _wait_aborts(server, aborts_before + 1)
    assert wait_pool_whole(server)
