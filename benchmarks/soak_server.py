"""Soak test of `shoal serve` (a benchmark, not a test): mixed traffic with disconnects.

Starts `shoal serve` on 127.0.0.1 in a subprocess and sends `--requests` requests from
`--concurrency` client tasks: chat, streamed chat, completions (one prompt or several) and
Batch API lines (uploaded as batches of `--batch-lines`, some cancelled mid-way). About 10 %
of the interactive requests are dropped by the client (a streamed response closed after its
first chunk, or a request abandoned on a short timeout), and ~1 in 10 batches is cancelled.
At the end it checks, and prints, that the pool is whole (no KV block in use, nothing running
or waiting) and that every batch's output and error files hold each `custom_id` exactly once.

    .venv/bin/python benchmarks/soak_server.py                      # bundled SmolLM2, 10,000
    .venv/bin/python benchmarks/soak_server.py --requests 2000 --model /path/to/model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import time
from collections import Counter

import httpx
from serve_process import start_serve

MESSAGES = ["Say hi.", "Name a colour.", "Count to three.", "What is 2 + 2?", "One word: sea."]


async def interactive(http: httpx.AsyncClient, model: str, rng: random.Random) -> str:
    """One interactive request; returns its outcome (a status code or 'dropped')."""
    kind = rng.choice(["chat", "stream", "completion", "multi"])
    drop = rng.random() < 0.10
    msg = [{"role": "user", "content": rng.choice(MESSAGES)}]
    if kind in ("chat", "stream"):
        url, body = "/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": 4}
    else:
        prompt = rng.choice(MESSAGES) if kind == "completion" else rng.sample(MESSAGES, 3)
        url, body = "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4}
    if kind == "stream":
        body["stream"] = True
        async with http.stream("POST", url, json=body) as r:
            async for _ in r.aiter_lines():
                if drop:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return str(r.status_code)
    try:
        r = await http.post(url, json=body, timeout=0.05 if drop else 300)
    except httpx.TimeoutException:
        return "dropped"
    return str(r.status_code)


async def batch(
    http: httpx.AsyncClient, model: str, rng: random.Random, n: int, tag: str
) -> tuple[str, set[str]]:
    """Upload and start a batch of `n` lines (maybe cancel it); returns its id and ids."""
    ids = {f"{tag}-{i}" for i in range(n)}
    lines = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": cid}],
                "max_tokens": 4,
            },
        }
        for cid in sorted(ids)
    ]
    data = "\n".join(json.dumps(x) for x in lines).encode()
    f = await http.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
    f.raise_for_status()
    b = await http.post(
        "/v1/batches",
        json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions"},
    )
    b.raise_for_status()
    batch_id = b.json()["id"]
    if rng.random() < 0.10:
        await asyncio.sleep(rng.random())
        await http.post(f"/v1/batches/{batch_id}/cancel")
    return batch_id, ids


async def check_batch(http: httpx.AsyncClient, batch_id: str, ids: set[str]) -> list[str]:
    """Wait for the batch to end; problems found in its result files."""
    while True:
        obj = (await http.get(f"/v1/batches/{batch_id}")).json()
        if obj["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        await asyncio.sleep(0.5)
    seen: Counter[str] = Counter()
    for key in ("output_file_id", "error_file_id"):
        if obj[key]:
            text = (await http.get(f"/v1/files/{obj[key]}/content")).text
            seen.update(json.loads(line)["custom_id"] for line in text.splitlines() if line)
    problems = [f"{batch_id}: {cid} missing" for cid in ids - set(seen)]
    problems += [f"{batch_id}: {cid} x{k}" for cid, k in seen.items() if k > 1]
    return problems


async def soak(args: argparse.Namespace, url: str) -> None:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        num_batches = args.requests * args.batch_share // 100 // args.batch_lines
        num_interactive = args.requests - num_batches * args.batch_lines
        outcomes: Counter[str] = Counter()
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(num_interactive):
            queue.put_nowait(i)

        async def client() -> None:
            while not queue.empty():
                queue.get_nowait()
                try:
                    outcomes[await interactive(http, model, rng)] += 1
                except httpx.HTTPError as e:
                    outcomes[type(e).__name__] += 1

        start_t = time.perf_counter()
        started = [
            await batch(http, model, rng, args.batch_lines, f"b{i}") for i in range(num_batches)
        ]
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        problems = [p for b, ids in started for p in await check_batch(http, b, ids)]
        wall = time.perf_counter() - start_t
        metrics = (await http.get("/metrics")).text

    def value(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", metrics, re.M)
        return float(found.group(1)) if found else float("nan")

    used = value("shoal_kv_cache_blocks_used")
    busy = value("shoal_num_requests_running") + value("shoal_num_requests_waiting")
    print(
        f"requests: {args.requests} ({num_interactive} interactive, "
        f"{num_batches} batches x {args.batch_lines} lines), concurrency {args.concurrency}"
    )
    print(f"wall: {wall:.1f} s, {args.requests / wall:.1f} requests/s")
    print("interactive outcomes:", dict(sorted(outcomes.items())))
    print(
        f"pool whole: {used == 0 and busy == 0} (blocks in use {used:.0f}, "
        f"requests left {busy:.0f})"
    )
    print(f"batch results missing or duplicated: {len(problems)}", *problems[:10], sep="\n  ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch-share", type=int, default=20, help="percent of requests in batches")
    p.add_argument("--batch-lines", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-soak-") as data_dir:
        proc, url = start_serve(data_dir, *(["--model", args.model] if args.model else []))
        try:
            asyncio.run(soak(args, url))
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
