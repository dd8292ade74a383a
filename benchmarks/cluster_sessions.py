"""W2 through 2 replicas on Ray Serve: what session-affine routing and the shared session tier
buy against a generic load balancer, and the ingress's HTTP overhead (issue 19).

One run, three setups of the same replicas (bundled SmolLM2 or `--model`, each setup on fresh
replicas: empty pools, prefix caches and tier), W2 each time: every turn of every session sent
at once over HTTP (`/v1/completions`, streamed, the session id in the body, EOS ignored; each
round's requests leave in a shuffled order, as agents answer in no set order):

  a  session-affine routing + shared session tier: shoal's cluster as shipped;
  b  round-robin + shared session tier: a turn that lands away from its session's last replica
     is restored from the tier (shoal's tier doing its job behind a router that ignores it);
  c  round-robin, no tier, no affinity: a generic load balancer in front of plain `shoal serve`
     replicas, the status quo issue 19 starts from. A moved turn recomputes its history (less
     what that replica's prefix cache holds: the shared system prompt, and the session's
     older turns if the session was there before).
  d  (optional, `--setups a,d`) session-affine without the tier: what the tier's write-behind
     costs when no replica dies.

Prints, per setup, total seconds and mean TTFT of turns 2.., where the session requests went
and what the engines did (prompt tokens reused and recomputed, tier writes, reads and lag),
then the ratios a/c (the issue's target: >= 2x in total and TTFT) and a/b. Last, the ingress's
HTTP overhead: short requests one at a time, alternating between the ingress and a direct
`shoal serve`. Replicas and the direct server run one torch thread each (`OMP_NUM_THREADS=1`
unless set).

    .venv/bin/python benchmarks/cluster_sessions.py               # W2: 16 sessions x 6 turns
    .venv/bin/python benchmarks/cluster_sessions.py --setups a,c --sessions 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per replica: 2 replicas, 2 cores

import httpx
from ray import serve

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


@dataclass(frozen=True, slots=True)
class Setup:
    key: str
    label: str
    policy: str  # the request router's: "affine" or "round_robin"
    tier: bool  # replicas share session KV through the tier


SETUPS = {
    s.key: s
    for s in (
        Setup("a", "session-affine + shared tier", "affine", True),
        Setup("b", "round-robin + shared tier", "round_robin", True),
        Setup("c", "round-robin, no tier (generic LB, plain replicas)", "round_robin", False),
        Setup("d", "session-affine, no tier (what the tier costs)", "affine", False),
    )
}


@dataclass(slots=True)
class Result:
    setup: Setup
    total_s: float
    ttft_s: float  # mean of turns 2..
    placements: dict[str, int]
    engine: dict[str, float]  # summed over replicas


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
    """Every session's turns, each turn of all sessions at once: (total s, mean TTFT 2.. s).
    The same prompts and send order for every setup (one seed)."""
    rng = random.Random(0)
    system = text(rng, args.system)
    histories = [system for _ in range(args.sessions)]
    ttfts: list[float] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        for t in range(args.turns):
            prompts = [h + "\n" + text(rng, args.user) for h in histories]
            order = list(range(args.sessions))
            rng.shuffle(order)  # a fixed order would let an even round-robin send every
            # session to the same replica each turn, by accident
            answers = await asyncio.gather(
                *(turn(client, model, f"{tag}-{i}", prompts[i], args.gen) for i in order)
            )
            results = dict(zip(order, answers, strict=True))
            histories = [p + results[i][0] for i, p in enumerate(prompts)]
            if t:
                ttfts += [ttft for _, ttft in results.values()]
            print(f"  {tag} turn {t + 1}: {time.perf_counter() - start:.1f} s", flush=True)
    return time.perf_counter() - start, statistics.mean(ttfts) if ttfts else 0.0


ENGINE_FIGURES = (
    "shoal_session_tokens_reused_total",
    "shoal_session_tokens_recomputed_total",
    "shoal_tier_writes_total",
    "shoal_tier_reads_total",
    "shoal_tier_lag_p95_ms",
)


def scrape(url: str) -> tuple[dict[str, int], dict[str, float]]:
    """The ingress's session placements and the engine figures, summed over replicas (the
    tier lag: the worst replica's)."""
    placements: dict[str, int] = {}
    engine: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=120).text.splitlines():
        m = re.match(r"(\w+)\{(.*)\} (\S+)$", line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name == "shoal_cluster_session_requests_total":
            placement = re.search(r'placement="(\w+)"', labels)
            if placement:
                placements[placement.group(1)] = placements.get(placement.group(1), 0) + int(value)
        elif name in ENGINE_FIGURES:
            combine = max if name.endswith("_ms") else sum
            engine[name] = combine((engine.get(name, 0.0), value))
    return placements, engine


def run_setup(
    setup: Setup, base: ServerConfig, args: argparse.Namespace, url: str, root: Path, first: bool
) -> Result:
    """Fresh replicas (new data dirs under `root`, an empty tier) with `setup`'s routing, then
    W2."""
    data = root / setup.key
    server = ServerConfig(engine=base.engine, data_dir=data)
    config = ClusterConfig(
        server,
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        policy=setup.policy,
        tier=setup.tier,
        app_name="shoal",
    )
    if first:
        start_local(config, "127.0.0.1", args.port)
    else:
        serve.delete(config.app_name)
        deploy(config)
    name = httpx.get(f"{url}/v1/models", timeout=600).json()["data"][0]["id"]
    print(f"({setup.key}) {setup.label}", flush=True)
    total, ttft = asyncio.run(w2(url, name, args, setup.key))
    placements, engine = scrape(url)
    return Result(setup, total, ttft, placements, engine)


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


def ingress_overhead(url: str, model: str, args: argparse.Namespace, root: Path) -> str:
    proc = direct_server(model, args.port + 1, str(root / "direct"), args.kv_cache_gib)
    try:
        name = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        direct_url = f"http://127.0.0.1:{args.port + 1}"
        via_ingress, direct = latencies([url, direct_url], name, args.requests)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    ing, dir_ = statistics.median(via_ingress), statistics.median(direct)
    return (
        f"one short request (1 token out), median of {args.requests}: ingress {1e3 * ing:.1f} ms,"
        f" direct shoal serve {1e3 * dir_:.1f} ms, overhead {1e3 * (ing - dir_):.1f} ms"
        f" ({ing / dir_:.2f}x)"
    )


def report(results: dict[str, Result]) -> None:
    print(
        "\n| setup | total s | mean TTFT turns 2.. s | session requests | prompt tokens "
        "reused / recomputed | tier writes / reads, lag p95 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results.values():
        where = ", ".join(f"{k} {v}" for k, v in sorted(r.placements.items()))
        e = r.engine
        tokens = (
            f"{int(e.get('shoal_session_tokens_reused_total', 0))} / "
            f"{int(e.get('shoal_session_tokens_recomputed_total', 0))}"
        )
        tier = (
            f"{int(e.get('shoal_tier_writes_total', 0))} / "
            f"{int(e.get('shoal_tier_reads_total', 0))}, {e.get('shoal_tier_lag_p95_ms', 0):.0f}"
            if r.setup.tier
            else "no tier"
        )
        print(
            f"| ({r.setup.key}) {r.setup.label} | {r.total_s:.1f} | {r.ttft_s:.2f} | {where} "
            f"| {tokens} | {tier} |"
        )
    a = results.get("a")
    for key, what in (("c", "a generic load balancer (c)"), ("b", "round-robin + tier (b)")):
        other = results.get(key)
        if a is None or other is None:
            continue
        ttft = other.ttft_s / a.ttft_s if a.ttft_s else float("nan")
        print(
            f"affine + tier (a) vs {what}: {other.total_s / a.total_s:.2f}x in total, "
            f"{ttft:.2f}x in TTFT"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--setups", default="a,b,c", help="which of a, b, c to run, in order")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=1000, help="words of the shared system prompt")
    p.add_argument("--user", type=int, default=150, help="words each turn adds")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="each replica's KV pool")
    p.add_argument("--requests", type=int, default=50, help="for the HTTP overhead (0: skip)")
    p.add_argument("--port", type=int, default=8790)
    args = p.parse_args()
    setups = [SETUPS[k.strip()] for k in args.setups.split(",")]
    model = args.model or str(bundled_model_path())
    engine = EngineConfig(model=model, kv_cache_bytes=int(args.kv_cache_gib * GiB))
    base = ServerConfig(engine=engine)
    url = f"http://127.0.0.1:{args.port}"
    print(
        f"W2 through {args.replicas} replicas: {args.sessions} sessions x {args.turns} turns, "
        f"system prompt {args.system} words, +{args.user} words and {args.gen} tokens a turn; "
        f"load average before: {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[str, Result] = {}
    overhead = ""
    # Data dirs and tiers (GBs of KV) go with the run.
    with tempfile.TemporaryDirectory(prefix="shoal-cluster-bench-") as tmp:
        root = Path(tmp)
        try:
            for i, setup in enumerate(setups):
                results[setup.key] = run_setup(setup, base, args, url, root, first=i == 0)
            if args.requests:
                overhead = ingress_overhead(url, model, args, root)
        finally:
            stop_local()
    report(results)
    if overhead:
        print(overhead)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
