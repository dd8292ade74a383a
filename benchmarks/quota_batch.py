"""Quota service: batch endpoints with the client Batcher vs one HTTP call per operation.

For each backend (SQLite, then Redis: a `redis-server` started here on a free loopback port),
`shoal quota serve` runs in a subprocess and `--pairs` jobs (default 10,000) each reserve
(rpm 1 + tpm 500 + one concurrency slot) and then complete (tpm actually 300). Capacities
are large: the run measures the limiter's cost, not denials. Two modes on the same server,
each after a short warm-up:

- per call: `AsyncQuotaClient(batching=False)`, one `POST /v1/reserve/batch` or
  `/v1/complete/batch` of one item per operation, `--per-call-concurrency` jobs in flight
  (default 8: on the 2-core machine this mode peaks there; 32 or 256 in flight only queue,
  and its pairs/s drop by a half or more);
- batched: the client `Batcher` (max 256 items, 2 ms flush interval) over the same
  endpoints, `--concurrency` jobs in flight (default 256, so batches fill).

Prints pairs/s of each, their ratio (target >= 10x), per-operation latency p50/p99, and the
p99 latency the Batcher adds (time an item waits in its queue before its batch is sent).

    .venv/bin/python benchmarks/quota_batch.py [--pairs 10000] [--concurrency 256]
        [--per-call-concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shoal.quota import (
    Actual,
    AsyncQuotaClient,
    Batcher,
    CompleteRequest,
    Requirement,
    ReserveRequest,
    new_lease_id,
)
from shoal.quota.testing import free_port, local_redis
from shoal.quota.transport import AsyncHTTPQuotaAPI

LIMITS = """
[[limit]]
key = "global:llm:openai:gpt-4o:rpm"
kind = "rate"
capacity = 1000000000
window_s = 60

[[limit]]
key = "global:llm:openai:gpt-4o:tpm"
kind = "rate"
capacity = 1000000000000
window_s = 60

[[limit]]
key = "global:jobs:concurrency"
kind = "concurrency"
capacity = 100000
"""
NEEDS = (
    Requirement("global:llm:openai:gpt-4o:rpm", 1),
    Requirement("global:llm:openai:gpt-4o:tpm", 500),
    Requirement("global:jobs:concurrency", 1),
)
SPENT = (Actual("global:llm:openai:gpt-4o:tpm", 300),)


@dataclass
class Run:
    pairs: int
    seconds: float
    latencies: list[float]
    waits: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.pairs / self.seconds


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cpu_line() -> str:
    info = dict.fromkeys(("Model name", "CPU family", "Model", "Flags"), "?")
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in info:
                info[key.strip()] = value.strip()
    except FileNotFoundError:
        info["Model name"] = platform.processor()
    flags = [f for f in ("avx2", "avx512f", "sha_ni") if f in info["Flags"].split()]
    return (
        f"CPU: {info['Model name']} (family {info['CPU family']}, model {info['Model']}; "
        f"{' '.join(flags)}), {len(os.sched_getaffinity(0))} cores"
    )


async def run(url: str, batched: bool, pairs: int, concurrency: int) -> Run:
    latencies: list[float] = []
    waits: list[float] = []
    api = AsyncHTTPQuotaAPI(url)
    client = AsyncQuotaClient(api, batching=False)
    batcher = Batcher(api, max_batch=256, flush_interval_s=0.002, on_queue_wait=waits.append)
    reserve = batcher.reserve if batched else client.reserve
    complete = batcher.complete if batched else client.complete
    todo = iter(range(pairs))

    async def worker() -> None:
        for _ in todo:
            lease = new_lease_id()
            started = time.perf_counter()
            got = await reserve(ReserveRequest(lease, NEEDS))
            latencies.append(time.perf_counter() - started)
            assert got.allowed, got
            started = time.perf_counter()
            done = await complete(CompleteRequest(lease, SPENT))
            latencies.append(time.perf_counter() - started)
            assert done.ok, done

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    await batcher.close()
    await client.aclose()
    return Run(pairs, seconds, latencies, waits)


def start_server(
    config: Path, data_dir: Path, backend: str | None
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    args = [sys.executable, "-m", "shoal.cli", "quota", "serve", "--config", str(config)]
    args += ["--port", str(port), "--data-dir", str(data_dir)]
    if backend:
        args += ["--backend", backend]
    proc = subprocess.Popen(args)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1).raise_for_status()
            return url, proc
        except httpx.HTTPError:
            assert proc.poll() is None, "the quota server exited"
            time.sleep(0.2)
    raise RuntimeError("the quota server did not start")


def measure(name: str, backend: str | None, tmp: Path, args: argparse.Namespace) -> None:
    config = tmp / "limits.toml"
    config.write_text(LIMITS)
    url, proc = start_server(config, tmp / name, backend)
    try:
        for batched in (False, True):  # warm-up: connections, code paths, SQLite pages
            asyncio.run(run(url, batched, 300, args.per_call_concurrency))
        single = asyncio.run(run(url, False, args.pairs, args.per_call_concurrency))
        batch = asyncio.run(run(url, True, args.pairs, args.concurrency))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ms = 1000
    print(f"\n{name}: {args.pairs} reserve+complete pairs")
    modes = (
        (f"one call per operation ({args.per_call_concurrency} in flight)", single),
        (f"Batcher + batch endpoints ({args.concurrency} in flight)", batch),
    )
    for label, r in modes:
        p50, p99 = pct(r.latencies, 0.5) * ms, pct(r.latencies, 0.99) * ms
        print(
            f"  {label:46s} {r.rate:6.0f} pairs/s ({2 * r.rate:9.0f} items/s)  "
            f"latency p50 {p50:6.1f} ms  p99 {p99:6.1f} ms"
        )
    print(f"  ratio: {batch.rate / single.rate:.1f}x (target >= 10x)")
    print(
        f"  Batcher added latency (queue wait): p50 {pct(batch.waits, 0.5) * ms:.2f} ms, "
        f"p99 {pct(batch.waits, 0.99) * ms:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=256, help="batched mode")
    parser.add_argument("--per-call-concurrency", type=int, default=8)
    args = parser.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        measure("SQLite", None, Path(tmp), args)
        with local_redis(Path(tmp)) as redis:
            measure("Redis", redis.url, Path(tmp), args)


if __name__ == "__main__":
    main()
