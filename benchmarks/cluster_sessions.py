"""W2 through 2 replicas on Ray Serve: session-affine routing against round-robin, and the
ingress's HTTP overhead against a direct `shoal serve` (issue 19).

One run: a local Ray with the ingress and N replicas of the bundled SmolLM2 (or `--model`),
each turn of every session sent at once over HTTP (`/v1/completions`, streamed, the session id
in the body, EOS ignored): first with `SessionAffinityRouter`, then with the same replicas
(same config, session tier included, new session ids) behind round-robin, as a generic load
balancer would spread them (each round's requests leave in a shuffled order). Then short
requests one at a time, alternating between the ingress and a direct `shoal serve`. Prints
totals, mean TTFT of turns 2.. and the ratios. Replicas and the direct server run one torch
thread each (`OMP_NUM_THREADS=1` unless set).

    .venv/bin/python benchmarks/cluster_sessions.py                 # W2: 16 sessions x 6 turns
    .venv/bin/python benchmarks/cluster_sessions.py --sessions 8 --turns 4 --system 500
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per replica: 2 replicas, 2 cores

import httpx

from shoal.cluster.app import ClusterConfig, deploy, start_local, stop_local
from shoal.config import EngineConfig, GiB
from shoal.models.files import bundled_model_path
from shoal.server.state import ServerConfig

COMMON_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part"
)
WORDS = COMMON_WORDS.split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def turn(
    client: httpx.AsyncClient, model: str, session: str, prompt: str, gen: int
) -> tuple[str, float]:
    """One streamed completion: (its text, seconds to the first token)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "session_id": session,
    }
    start, first, out = time.perf_counter(), None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if first is None:
                first = time.perf_counter() - start
            out.append(piece)
    return "".join(out), first or 0.0


async def w2(url: str, model: str, args: argparse.Namespace, tag: str) -> tuple[float, float]:
    """Every session's turns, each turn of all sessions at once: (total s, mean TTFT 2.. s)."""
    rng = random.Random(0)
    system = text(rng, args.system)
    histories = [system for _ in range(args.sessions)]
    ttfts: list[float] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        for t in range(args.turns):
            prompts = [h + "\n" + text(rng, args.user) for h in histories]
            order = list(range(args.sessions))
            rng.shuffle(order)  # agents answer in no set order (a fixed one would let an even
            # round-robin send every session to the same replica each turn, by accident)
            results = dict(
                zip(
                    order,
                    await asyncio.gather(
                        *(turn(client, model, f"{tag}-{i}", prompts[i], args.gen) for i in order)
                    ),
                    strict=True,
                )
            )
            histories = [p + results[i][0] for i, p in enumerate(prompts)]
            if t:
                ttfts += [ttft for _, ttft in results.values()]
            print(f"  {tag} turn {t + 1}: {time.perf_counter() - start:.1f} s", flush=True)
    return time.perf_counter() - start, statistics.mean(ttfts) if ttfts else 0.0


def latencies(urls: list[str], model: str, n: int) -> list[list[float]]:
    """`n` short requests to each of `urls`, one at a time and alternating between them (so a
    busy moment hits both alike): seconds each, per url (a warm-up first, dropped)."""
    out: list[list[float]] = [[] for _ in urls]
    clients = [httpx.Client(base_url=url, timeout=600) for url in urls]
    try:
        for i in range(n + 1):
            for client, times in zip(clients, out, strict=True):
                body = {"model": model, "prompt": f"Hello number {i}", "max_tokens": 1}
                start = time.perf_counter()
                client.post("/v1/completions", json=body).raise_for_status()
                if i:
                    times.append(time.perf_counter() - start)
    finally:
        for client in clients:
            client.close()
    return out


def placements(url: str) -> str:
    """The router's session placement counts, summed over replicas."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=120).text.splitlines():
        if line.startswith("shoal_cluster_session_requests_total{"):
            placement = line.split('placement="')[1].split('"')[0]
            totals[placement] = totals.get(placement, 0) + float(line.rsplit(" ", 1)[1])
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(totals.items()))


def direct_server(model: str, port: int, data: str, kv_gib: float) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "shoal.cli", "serve", "--model", model, "--port", str(port)]
    argv += ["--kv-cache-gib", str(kv_gib)]
    proc = subprocess.Popen([*argv, "--data-dir", data], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("shoal serve did not start")
        time.sleep(0.5)


def print_w2(affine: tuple[float, float], robin: tuple[float, float]) -> None:
    print("\n| routing | total s | mean TTFT turns 2.. s |")
    print("| --- | --- | --- |")
    print(f"| session-affine | {affine[0]:.1f} | {affine[1]:.2f} |")
    print(f"| round-robin | {robin[0]:.1f} | {robin[1]:.2f} |")
    ttft_ratio = robin[1] / affine[1] if affine[1] else float("nan")
    print(f"affine vs round-robin: {robin[0] / affine[0]:.2f}x total, {ttft_ratio:.2f}x TTFT\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=1000, help="words of the shared system prompt")
    p.add_argument("--user", type=int, default=150, help="words each turn adds")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="each replica's KV pool")
    p.add_argument("--requests", type=int, default=50, help="for the HTTP overhead")
    p.add_argument("--port", type=int, default=8790)
    args = p.parse_args()
    model = args.model or str(bundled_model_path())
    data = tempfile.mkdtemp(prefix="shoal-cluster-bench-")
    engine = EngineConfig(model=model, kv_cache_bytes=int(args.kv_cache_gib * GiB))
    server = ServerConfig(engine=engine, data_dir=Path(data))
    config = ClusterConfig(server, replicas=args.replicas, replica_cpus=args.replica_cpus)
    url = f"http://127.0.0.1:{args.port}"
    start_local(config, "127.0.0.1", args.port)
    try:
        name = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        print(f"W2 through {args.replicas} replicas: {args.sessions} sessions x {args.turns} turns")
        affine = asyncio.run(w2(url, name, args, "affine"))
        print(f"  session requests: {placements(url)}")
        deploy(dataclasses.replace(config, policy="round_robin"))
        robin = asyncio.run(w2(url, name, args, "robin"))
        print(f"  session requests (both runs): {placements(url)}")
        print_w2(affine, robin)
        direct_data = tempfile.mkdtemp(prefix="shoal-direct-")
        proc = direct_server(model, args.port + 1, direct_data, args.kv_cache_gib)
        try:
            direct_url = f"http://127.0.0.1:{args.port + 1}"
            via_ingress, direct = latencies([url, direct_url], name, args.requests)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    finally:
        stop_local()

    ing, dir_ = statistics.median(via_ingress), statistics.median(direct)
    print(
        f"one short request (1 token out), median of {args.requests}: ingress {1e3 * ing:.1f} ms,"
        f" direct shoal serve {1e3 * dir_:.1f} ms, overhead {1e3 * (ing - dir_):.1f} ms"
        f" ({ing / dir_:.2f}x)"
    )


if __name__ == "__main__":
    main()
