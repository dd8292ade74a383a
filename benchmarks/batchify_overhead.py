"""Client cost of `shoal.batchify`: 1,000 chat calls from 1,000 coroutines, direct vs batched.

A `shoal serve` runs in a subprocess on 127.0.0.1. The same unmodified `openai.AsyncOpenAI`
code runs four ways: direct (one HTTP request per call), inside `batchify()` (the calls
travel as one Batch API job), inside `batchify(dry_run=True)` (no server work: SDK plus
interception, queueing and replies), and through a no-op transport outside any scope (the SDK
alone). Dry run minus SDK alone (medians of `--rounds` alternating rounds) is the library's
own client cost per call. Each way against
the server gets its own prompts, so the server's prefix cache favours none.

    .venv/bin/python benchmarks/batchify_overhead.py            # bundled SmolLM2, 1,000 calls

Prints, for each way: HTTP requests the client sent, wall time, client CPU time per call;
then the request ratio batchify/direct (target <= 1 %) and the library's client overhead per
call (target < 1 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
from serve_process import free_port

from shoal.batchify import batchify
from shoal.batchify.adapters import ADAPTERS

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Run:
    name: str
    calls: int
    requests: int
    wall_s: float
    cpu_s: float
    batches: int = 0

    def line(self) -> str:
        return (
            f"{self.name:>9}: {self.calls} calls, {self.requests} HTTP requests, "
            f"wall {self.wall_s:.2f} s, client CPU {self.cpu_s:.2f} s "
            f"({1000 * self.cpu_s / self.calls:.3f} ms/call), batches {self.batches}"
        )


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "CPU: unknown (no lscpu)"
    info = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    flags = set(info.get("Flags", "").split())
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return (
        f"CPU: {info.get('Model name', '?').strip()}, family {info.get('CPU family', '?').strip()}"
        f", model {info.get('Model', '?').strip()}, {os.cpu_count()} cores, flags {' '.join(shown)}"
    )


def start_server(args: argparse.Namespace, port: int, data_dir: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(port)]
    cmd += ["--data-dir", data_dir, "--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        cmd += ["--model", args.model]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited during startup")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=1)
            if models.status_code == 200:
                return str(models.json()["data"][0]["id"])
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not start")


async def calls(client: openai.AsyncOpenAI, model: str, tag: str, args: argparse.Namespace) -> Any:
    return await asyncio.gather(
        *(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"{tag} question {i}: name a colour."}],
                max_tokens=args.max_tokens,
                temperature=0,
            )
            for i in range(args.num_calls)
        )
    )


async def measure(name: str, url: str, model: str, args: argparse.Namespace, **scope: Any) -> Run:
    sent = 0

    async def count(_: httpx.Request) -> None:
        nonlocal sent
        sent += 1

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [count]})
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=3600, http_client=http
    )
    if name == "sdk alone":  # canned replies from a transport that does nothing
        reply = ADAPTERS["openai"].dry_run_body("/v1/chat/completions", {"model": model}, "x")
        noop = httpx2.AsyncClient(
            transport=httpx2.MockTransport(lambda _: httpx2.Response(200, json=reply))
        )
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", http_client=noop)
    t0, c0 = time.perf_counter(), time.process_time()
    if name in ("direct", "sdk alone"):
        replies = await calls(client, model, name, args)
        run = Run(name, len(replies), sent, time.perf_counter() - t0, time.process_time() - c0)
    else:
        async with batchify(**scope) as b:
            replies = await calls(client, model, name, args)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        run = Run(name, len(replies), b.provider_requests, wall, cpu, b.stats.batches)
    await client.close()
    return run


async def main_async(args: argparse.Namespace, url: str, model: str, cache: Path) -> list[Run]:
    scope: dict[str, Any] = {
        "batch_size": args.num_calls,
        "window_s": 5.0,
        "poll_interval_s": args.poll_interval_s,
        "live_progress": False,
    }
    dry_scope = {**scope, "window_s": 0.0}
    await measure("sdk alone", url, model, args)  # warm-up: the SDK's lazy imports
    direct = await measure("direct", url, model, args)
    batched = await measure("batchify", url, model, args, cache_path=cache, **scope)
    # The client-only ways take seconds and a shared machine is noisy: alternate them for
    # `--rounds` rounds and keep each one's median round.
    dry, sdk = [], []
    for _ in range(args.rounds):
        dry.append(await measure("dry run", url, model, args, dry_run=True, **dry_scope))
        sdk.append(await measure("sdk alone", url, model, args))
    return [direct, batched, median(dry), median(sdk)]


def median(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.cpu_s)[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-calls", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--poll-interval-s", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the client-only ways")
    args = p.parse_args()
    print(cpu_line())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(args, port, f"{tmp}/data")
        try:
            model = wait_ready(url, proc)
            runs = asyncio.run(main_async(args, url, model, Path(tmp) / "cache.sqlite3"))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    for r in runs:
        print(r.line())
    direct, batched, dry, sdk = runs
    print(
        f"HTTP requests batchify/direct: {batched.requests}/{direct.requests} = "
        f"{100 * batched.requests / direct.requests:.2f} % (target <= 1 %)"
    )
    per_call = (dry.cpu_s - sdk.cpu_s) / dry.calls
    print(
        f"client overhead of batchify per call (dry run - SDK alone): CPU {1000 * per_call:.3f}"
        f" ms, wall {1000 * (dry.wall_s - sdk.wall_s) / dry.calls:.3f} ms (target < 1 ms)"
    )


if __name__ == "__main__":
    main()
