"""W3, "agent fleet": agents that resend their whole conversation every turn, with no session
header (as Codex CLI and the OpenAI Agents SDK do), on a KV pool a quarter of their working set.

32 agents x 8 turns, every agent's turn t in one wave (interleaved), a 2,000-token system
prompt they all share, +200 user tokens and 32 generated tokens a turn (EOS ignored). shoal
with its KV store in tiers (blocks the pool evicts go to host memory, then disk; a prefix hit
anywhere promotes them back) runs against shoal with prefix caching in the pool only (no host
memory, no disk) and against vLLM's CPU backend with automatic prefix caching and the same KV
budget (`benchmarks/vllm_peer.py`, one process per part). Then both restart (shoal keeps its
disk tier under `cache_dir`; a new vLLM process starts empty) and play 2 more turns.

    .venv/bin/python benchmarks/w3_fleet.py                      # the whole workload
    .venv/bin/python benchmarks/w3_fleet.py --agents 8 --turns 3 --after 1 --skip-vllm
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import plotting
import torch
import vllm_peer

from shoal import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30
KV_BYTES_PER_TOKEN = {"float32": 46_080, "bfloat16": 23_040}  # SmolLM2-135M


@dataclass
class Turn:
    seconds: float
    ttfts: list[float]


def conversation(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(0)
    system = [rng.randrange(100, 40_000) for _ in range(args.system)]
    users = [
        [[rng.randrange(100, 40_000) for _ in range(args.user)] for _ in range(args.agents)]
        for _ in range(args.turns + args.after)
    ]
    return system, users


def working_set_tokens(args: argparse.Namespace) -> int:
    per_agent = (args.turns + args.after) * (args.user + args.gen)
    return args.system + args.agents * per_agent


def wave(llm: LLM, histories: list[list[int]], users: list[list[int]], gen: int) -> Turn:
    prompts = [h + u for h, u in zip(histories, users, strict=True)]
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)  # no session ids: a full resend
    seconds = time.perf_counter() - start
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        histories[i] = p + o.token_ids
    return Turn(seconds, [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs])


def run_shoal(args: argparse.Namespace, tiers: bool, kv_bytes: int) -> tuple[list[Turn], int]:
    """The turns, and the bytes of the model's weights."""
    system, users = conversation(args)
    histories = [list(system) for _ in range(args.agents)]
    with tempfile.TemporaryDirectory(prefix="shoal-w3-") as cache_dir:
        kw = dict(
            dtype=args.dtype,
            max_num_seqs=args.agents,
            kv_cache_bytes=kv_bytes,
            cache_dir=cache_dir if tiers else None,
            host_kv_bytes=int(args.host_gib * GiB) if tiers else 0,
            disk_kv_bytes=int(args.disk_gib * GiB) if tiers else 0,
        )
        llm = LLM(**kw)
        turns: list[Turn] = []
        for t in range(args.turns + args.after):
            if t == args.turns:
                llm.close()  # a clean stop: what the store holds goes to disk
                del llm
                gc.collect()
                llm = LLM(**kw)
            turns.append(wave(llm, histories, users[t], args.gen))
            name = "shoal tiers" if tiers else "shoal pool only"
            print(
                f"  {name} turn {t + 1}: {turns[-1].seconds:.1f} s, "
                f"mean TTFT {statistics.mean(turns[-1].ttfts):.2f} s"
            )
        s = llm.stats()
        print(
            f"  hit rate {s.prefix_cache_hit_rate:.2f}, preemptions {s.num_preemptions}; "
            f"promoted host {s.kv_host_promotions}, "
            f"disk {s.kv_disk_promotions}; demoted host {s.kv_host_demotions}, "
            f"disk {s.kv_disk_demotions}; host {s.kv_host_bytes / GiB:.2f} GiB, "
            f"disk {s.kv_disk_bytes / GiB:.2f} GiB"
        )
        llm.close()
    return turns, sum(s.weight_bytes.values())


def run_vllm(args: argparse.Namespace, root: Path, kv_gib: int) -> list[Turn]:
    system, users = conversation(args)
    histories = [list(system) for _ in range(args.agents)]
    turns: list[Turn] = []
    for part in (users[: args.turns], users[args.turns :]):
        if not part:
            continue
        timed, histories = vllm_peer.w2(
            root, args.dtype, histories, part, args.gen, torch.get_num_threads(), kv_gib
        )
        for seconds, ttfts in timed:
            turns.append(Turn(seconds, ttfts))
            mean = statistics.mean(ttfts)
            print(f"  vLLM turn {len(turns)}: {seconds:.1f} s, mean TTFT {mean:.2f} s")
    return turns


def summary(turns: list[Turn], first: int, last: int) -> tuple[float, float]:
    """Total seconds of turns [first, last) and their mean TTFT."""
    part = turns[first:last]
    return sum(t.seconds for t in part), statistics.mean(x for t in part for x in t.ttfts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8, help="turns before the restart")
    ap.add_argument("--after", type=int, default=2, help="turns after the restart")
    ap.add_argument("--system", type=int, default=2000)
    ap.add_argument("--user", type=int, default=200)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="of the working set")
    ap.add_argument("--host-gib", type=float, default=4.0)
    ap.add_argument("--disk-gib", type=float, default=16.0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--skip-vllm", action="store_true")
    plotting.add_argument(ap, "w3_fleet")
    args = ap.parse_args()
    tokens = working_set_tokens(args)
    longest = args.system + (args.turns + args.after) * (args.user + args.gen)
    # A quarter of the working set, but room for two of the longest requests at least.
    kv_tokens = max(tokens * args.pool_fraction, 2 * longest)
    kv_bytes = int(kv_tokens * KV_BYTES_PER_TOKEN[args.dtype])
    vllm_gib = max(1, round(kv_bytes / GiB))  # vLLM takes whole GiB
    print(
        f"W3: {args.agents} agents x {args.turns}+{args.after} turns (restart between), system "
        f"{args.system}, +{args.user} / {args.gen} out a turn, full resend; working set "
        f"{tokens} tokens, KV pool {kv_bytes / GiB:.2f} GiB (vLLM {vllm_gib} GiB); "
        f"{args.dtype}, {torch.get_num_threads()} threads"
    )
    vllm_root = None if args.skip_vllm else vllm_peer.setup(REPO)
    tiers, weights = run_shoal(args, True, kv_bytes)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    pool_only, _ = run_shoal(args, False, kv_bytes)
    vllm = None if vllm_root is None else run_vllm(args, vllm_root, vllm_gib)
    n, end = args.turns, args.turns + args.after
    for label, a, b in ((f"turns 2-{n}", 1, n), ("after restart", n, end)):
        if b <= a:
            continue
        tf, pf = summary(tiers, a, b)[1], summary(pool_only, a, b)[1]
        line = f"{label:14} TTFT tiers {tf:6.2f} s, pool only {pf:6.2f} s ({pf / tf:4.1f}x)"
        if vllm is not None:
            vf = summary(vllm, a, b)[1]
            line += f", vLLM {vf:6.2f} s ({vf / tf:4.1f}x)"
        print(line)
    total = summary(tiers, 0, end)[0]
    line = f"total time     tiers {total:6.1f} s, pool only {summary(pool_only, 0, end)[0]:6.1f} s"
    if vllm is not None:
        line += (
            f", vLLM {summary(vllm, 0, end)[0]:6.1f} s ({summary(vllm, 0, end)[0] / total:4.1f}x)"
        )
    print(line)
    budget = (weights + kv_bytes + args.host_gib * GiB) / GiB
    print(
        f"peak RSS of this process after the tiered run: {rss:.2f} GiB; weights + KV pool + "
        f"host tier cap: {budget:.2f} GiB (the rest is torch and the steps' buffers)"
    )
    ways = {"shoal, KV store in tiers": tiers, "shoal, pool only": pool_only}
    if vllm is not None:
        ways["vLLM CPU, prefix caching"] = vllm
    plotting.lines(
        args.plot,
        f"W3: {args.agents} agents, full resend, restart after turn {args.turns}",
        {
            who: (range(1, len(turns) + 1), [statistics.mean(t.ttfts) for t in turns])
            for who, turns in ways.items()
        },
        "turn",
        "mean TTFT (s)",
    )


if __name__ == "__main__":
    main()
