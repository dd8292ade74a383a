"""HTTP serving overhead: 64 concurrent streaming clients over HTTP vs the in-process AsyncEngine.

The same workload runs twice on the same model and engine settings: first through
`AsyncEngine.generate` in this process, then through `/v1/completions` (SSE streaming) on a
`shoal` server started in a subprocess on 127.0.0.1. Prompts are token ids (no tokenizer
differences), greedy, EOS ignored, so both runs generate exactly the same number of tokens.

    .venv/bin/python benchmarks/http_vs_inprocess.py --num-requests 128 --max-tokens 32

Each side runs `--rounds` times (default 3) and reports its median round, since a 2-core
machine's run-to-run noise (+-15%) is larger than the overhead being measured. Prints output
tokens/s of both, their ratio (target >= 0.9), and p50/p99 time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from serve_process import free_port

if TYPE_CHECKING:  # imported in main(), after OMP_NUM_THREADS is set
    from shoal.engine.async_engine import AsyncEngine

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Result:
    tokens: int
    seconds: float
    ttfts: list[float]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def pct(self, q: float) -> float:
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def workload(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run_inprocess(
    aeng: AsyncEngine, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> Result:
    from shoal.sampling_params import SamplingParams

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            first = None
            n = 0
            async for out in aeng.generate(prompt, params):
                if first is None and out.token_ids:
                    first = time.perf_counter() - t0
                n = len(out.token_ids)
            ttfts.append(first if first is not None else time.perf_counter() - t0)
            tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Result(tokens, time.perf_counter() - start, ttfts)


async def run_http(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> Result:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency + 4)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            t0 = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"]:
                        first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return Result(tokens, time.perf_counter() - start, ttfts)


def start_server(args: argparse.Namespace, port: int, data_dir: str) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from pathlib import Path; from shoal.server.app import run_server; "
        "from shoal.config import EngineConfig; from shoal.server.state import ServerConfig; "
        "a = sys.argv[1:]; engine = EngineConfig(model=a[0] or None, dtype=a[1], "
        "max_num_seqs=int(a[2]), max_waiting=100000); "
        "run_server(ServerConfig(engine=engine, data_dir=Path(a[3])), '127.0.0.1', int(a[4]), "
        "log_level='warning')"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        args.model or "",
        args.dtype,
        str(args.max_num_seqs),
        data_dir,
        str(port),
    ]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited during startup")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not start")


def report(name: str, r: Result) -> None:
    print(
        f"{name:>10}: {r.tokens} tokens in {r.seconds:.2f} s = {r.rate:.1f} tok/s; "
        f"TTFT p50 {1000 * r.pct(0.5):.0f} ms, p99 {1000 * r.pct(0.99):.0f} ms"
    )


def median_round(rounds: list[Result]) -> Result:
    return sorted(rounds, key=lambda r: r.rate)[len(rounds) // 2]


def run_local(
    args: argparse.Namespace,
) -> tuple[Result, str, list[list[list[int]]], list[list[int]]]:
    from shoal.config import EngineConfig
    from shoal.engine.async_engine import AsyncEngine
    from shoal.engine.llm_engine import Engine

    engine = Engine(
        EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    )
    vocab = engine.model_config.vocab_size
    # Fresh prompts every round: a repeated round would be served from the prefix cache.
    rounds = [
        workload(vocab, args.num_requests, *args.prompt_len, seed=r) for r in range(args.rounds)
    ]
    warm = workload(vocab, 4, 16, 32, seed=-1)

    async def inprocess() -> Result:
        aeng = AsyncEngine(engine)
        await run_inprocess(aeng, warm, 4, 4)
        results = [
            await run_inprocess(aeng, prompts, args.max_tokens, args.concurrency)
            for prompts in rounds
        ]
        await aeng.shutdown(5)
        return median_round(results)

    return asyncio.run(inprocess()), engine.model_name, rounds, warm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="runs per side; the median is kept")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for both runs (1 avoids OpenMP spinning on a busy host)",
    )
    args = p.parse_args()
    if args.threads:  # before torch loads: OpenMP reads it once, for every thread
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    local, model_name, rounds, warm = run_local(args)
    gc.collect()  # free the in-process engine's KV before the server allocates its own

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data_dir:
        proc = start_server(args, port, data_dir)
        try:
            wait_ready(url, proc)
            asyncio.run(run_http(url, model_name, warm, 4, 4))
            http = median_round(
                [
                    asyncio.run(
                        run_http(url, model_name, prompts, args.max_tokens, args.concurrency)
                    )
                    for prompts in rounds
                ]
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    print(
        f"model {model_name}, {args.num_requests} requests, {args.concurrency} concurrent "
        f"streams, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.max_tokens} tokens out, torch threads {torch.get_num_threads()}, "
        f"median of {args.rounds} rounds"
    )
    report("in-process", local)
    report("http", http)
    print(f"HTTP / in-process throughput: {http.rate / local.rate:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
