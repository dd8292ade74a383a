"""W2, agentic: many sessions, many turns, one shared system prompt (issue 3).

Each session's turn t sends its whole conversation so far plus ~150 new user tokens and
generates 64 tokens (EOS ignored). shoal with sessions (restarted between turns 3 and 4, so
turn 4 is restored from `cache_dir`) runs against shoal with prefix caching and sessions off,
which recomputes every context every turn, and against vLLM's CPU backend with automatic
prefix caching (`benchmarks/vllm_peer.py`), whose process is restarted at the same point: a new
vLLM process has an empty prefix cache, so its turn 4 recomputes every context where shoal
restores its sessions from disk. Then a micro-benchmark: restoring 32 blocks x 48 layers from
host memory into the pool.

    .venv/bin/python benchmarks/w2_sessions.py                  # 16 sessions x 6 turns
    .venv/bin/python benchmarks/w2_sessions.py --sessions 4 --turns 4 [--skip-vllm]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import plotting
import torch
import vllm_peer

from shoal import LLM, SamplingParams
from shoal.layers import cpu_kernels

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Turn:
    seconds: float
    ttfts: list[float]

    def report(self, who: str, number: int) -> None:
        print(
            f"  {who} turn {number}: {self.seconds:.1f} s, "
            f"mean TTFT {statistics.mean(self.ttfts):.2f} s"
        )


def make_conversation(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(0)
    system = [rng.randrange(100, 40_000) for _ in range(args.system)]
    users = [
        [
            [rng.randrange(100, 40_000) for _ in range(rng.randint(args.user - 20, args.user + 20))]
            for _ in range(args.sessions)
        ]
        for _ in range(args.turns)
    ]
    return system, users


def play(
    llm: LLM, histories: list[list[int]], users: list[list[int]], sessions: bool, gen: int
) -> Turn:
    """One turn of every session at once; `histories` grow in place."""
    prompts = [h + u for h, u in zip(histories, users, strict=True)]
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    sids = [f"agent-{i}" for i in range(len(prompts))] if sessions else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, session_id=sids, use_tqdm=False)
    seconds = time.perf_counter() - start
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        histories[i] = p + o.token_ids
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    return Turn(seconds, ttfts)


def run(args: argparse.Namespace, sessions: bool, cache_dir: str | None) -> list[Turn]:
    system, users = make_conversation(args)
    histories = [list(system) for _ in range(args.sessions)]
    kw = {"cache_dir": cache_dir} if sessions else {"enable_prefix_caching": False}
    llm = LLM(max_num_seqs=args.sessions, dtype=args.dtype, **kw)
    turns = []
    for t in range(args.turns):
        if sessions and t == args.restart_before - 1:
            llm.close()  # saves every session to cache_dir
            del llm
            gc.collect()
            llm = LLM(max_num_seqs=args.sessions, dtype=args.dtype, **kw)
        turns.append(play(llm, histories, users[t], sessions, args.gen))
        turns[-1].report("sessions" if sessions else "baseline", t + 1)
    if sessions:
        s = llm.stats()
        print(
            f"  session hits {s.session_hits}, tokens reused {s.session_tokens_reused}, "
            f"computed {s.session_tokens_recomputed}, disk reads {s.disk_reads}, "
            f"restore p50 {s.restore_latency_p50_ms:.1f} ms p95 {s.restore_latency_p95_ms:.1f} ms"
        )
    llm.close()
    return turns


def run_vllm(args: argparse.Namespace, root: Path) -> list[Turn]:
    """The same conversations through vLLM, one process before the restart and one after."""
    system, users = make_conversation(args)
    histories = [list(system) for _ in range(args.sessions)]
    r = args.restart_before - 1
    parts = [users[:r], users[r:]] if 0 < r < args.turns else [users]
    threads = torch.get_num_threads()
    turns: list[Turn] = []
    for part in parts:
        timed, histories = vllm_peer.w2(root, args.dtype, histories, part, args.gen, threads)
        for seconds, ttfts in timed:
            turns.append(Turn(seconds, ttfts))
            turns[-1].report("vLLM", len(turns))
    return turns


def restore_micro(blocks: int = 32, layers: int = 48, iters: int = 200) -> dict[str, list[float]]:
    """Host memory -> pool for SmolLM2-shaped blocks (3 KV heads x 64, 16 tokens, float32):
    each layout's restore times, in seconds."""
    kernels = cpu_kernels.native()
    if kernels is None:
        print("restore micro-benchmark: no C++ kernels here")
        return {}
    measured: dict[str, list[float]] = {}
    shape = (4 * blocks + 64, 16, 3, 64)
    caches = [torch.randn(shape) for _ in range(2 * layers)]
    for name, ids in (
        ("contiguous", list(range(64, 64 + blocks))),
        ("scattered", random.Random(0).sample(range(shape[0]), blocks)),
    ):
        index = torch.tensor(ids)
        host = kernels.gather_blocks(caches, index)
        srcs = [t.data_ptr() for t in host]
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            kernels.scatter_blocks(srcs, caches, index)
            times.append(time.perf_counter() - start)
        times.sort()
        measured[f"{name} ids"] = times
        p50, p95 = times[len(times) // 2], times[int(0.95 * len(times))]
        mb = sum(t.numel() for t in host) / 1e6
        print(
            f"restore {blocks} blocks x {layers} layers ({mb:.0f} MB, {name} ids): "
            f"p50 {1e3 * p50:.2f} ms, p95 {1e3 * p95:.2f} ms"
        )
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=1000, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=150, help="user tokens per turn (+-20)")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per turn")
    ap.add_argument("--restart-before", type=int, default=4, help="restart before this turn")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--skip-vllm", action="store_true")
    plotting.add_argument(ap, "w2_sessions")  # and <plot>_restore.png, the restore CDF
    args = ap.parse_args()
    print(
        f"W2: {args.sessions} sessions x {args.turns} turns, system {args.system} tokens, "
        f"+{args.user} user / {args.gen} generated per turn; torch threads "
        f"{torch.get_num_threads()}, {args.dtype}"
    )
    vllm_root = None if args.skip_vllm else vllm_peer.setup(REPO)  # builds once, before timing
    with tempfile.TemporaryDirectory(prefix="shoal-w2-") as cache_dir:
        with_sessions = run(args, True, cache_dir)
    baseline = run(args, False, None)
    vllm = None if vllm_root is None else run_vllm(args, vllm_root)

    def summary(turns: list[Turn]) -> tuple[float, float]:
        later = [x for t in turns[1:] for x in t.ttfts]
        return sum(t.seconds for t in turns), statistics.mean(later)

    (st, sttft), (bt, bttft) = summary(with_sessions), summary(baseline)
    print(f"total time   sessions {st:8.1f} s   baseline {bt:8.1f} s   ratio {bt / st:5.1f}x")
    print(
        f"TTFT t2-t{args.turns}  sessions {sttft:8.2f} s   baseline {bttft:8.2f} s   "
        f"ratio {bttft / sttft:5.1f}x"
    )
    if vllm is not None:
        vt, vttft = summary(vllm)
        print(
            f"vLLM (automatic prefix caching) total {vt:.1f} s, "
            f"TTFT t2-t{args.turns} {vttft:.2f} s; "
            f"ratio vLLM / shoal sessions: total {vt / st:.2f}x, TTFT {vttft / sttft:.2f}x"
        )
    r = args.restart_before - 1
    if 0 < r < args.turns:
        restored = statistics.mean(with_sessions[r].ttfts)
        recomputed = statistics.mean(baseline[r].ttfts)
        print(
            f"turn {r + 1} TTFT after restart: restored from disk {restored:.2f} s, "
            f"recomputed {recomputed:.2f} s, ratio {recomputed / restored:.1f}x"
        )
        if vllm is not None:
            fresh = statistics.mean(vllm[r].ttfts)
            print(
                f"turn {r + 1} TTFT after restart, vLLM (a new process recomputes): {fresh:.2f} s, "
                f"ratio vLLM / shoal restored {fresh / restored:.1f}x"
            )
    ways = {"shoal sessions": with_sessions, "shoal, no caching or sessions": baseline}
    if vllm is not None:
        ways["vLLM CPU, prefix caching"] = vllm
    plotting.lines(
        args.plot,
        f"W2: {args.sessions} sessions, restart before turn {args.restart_before}",
        {
            who: (range(1, len(turns) + 1), [statistics.mean(t.ttfts) for t in turns])
            for who, turns in ways.items()
        },
        "turn",
        "mean TTFT (s)",
    )
    restores = restore_micro()
    plotting.cdf(
        plotting.beside(args.plot, "restore"),
        "Restore 32 blocks x 48 layers from host memory",
        {name: [1e3 * t for t in times] for name, times in restores.items()},
        "ms",
    )


if __name__ == "__main__":
    main()
