"""Draw the docs' benchmark plots (docs/img/*.png) from figures already recorded in
docs/benchmarks.md, not from a new run: each dict below names the table it copies. The
scripts draw the same kinds of plot from their own runs (`--plot`).

    .venv/bin/python benchmarks/plot_recorded.py [--out docs/img]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import plotting

REPO = Path(__file__).resolve().parent.parent

# "W1 against vLLM CPU": AMD EPYC Zen 4 (family 25, model 17), 2 cores, one run per group.
W1_ZEN4 = {
    "float32 #1": {"shoal": 158.0, "vLLM CPU": 166.8, "llama-server": 116.9,
                   "llama.cpp bench": 121.5, "transformers": 56.4},
    "float32 #2": {"shoal": 189.4, "vLLM CPU": 171.9, "llama-server": 117.1,
                   "llama.cpp bench": 123.9, "transformers": 55.7},
    "float32 #3": {"shoal": 195.7, "vLLM CPU": 177.1, "llama-server": 125.6,
                   "llama.cpp bench": 125.8, "transformers": 58.1},
    "bfloat16 #1": {"shoal": 370.6, "vLLM CPU": 294.2, "llama-server": 188.3,
                    "llama.cpp bench": 175.2},
    "bfloat16 #2": {"shoal": 366.4, "vLLM CPU": 281.9, "llama-server": 191.6,
                    "llama.cpp bench": 203.4},
}  # fmt: skip

# The measured table's W2 rows (Zen 4): mean TTFT in seconds.
W2_TTFT = {
    "turns 2-6": {"shoal sessions": 4.75, "vLLM CPU, prefix caching": 6.76,
                  "shoal, no caching or sessions": 24.83},
    "turn 4, after a restart": {"shoal sessions": 4.81, "vLLM CPU, prefix caching": 15.31,
                                "shoal, no caching or sessions": 25.03},
}  # fmt: skip

# The measured table's restore rows, ms: 32 blocks x 48 layers from host memory into the pool
# (two block-id layouts), and W2's turn 4 restores from disk.
RESTORE_MS = {
    "host memory, contiguous ids": {"p50": 2.42, "p95": 4.04},
    "host memory, scattered ids": {"p50": 3.20, "p95": 3.93},
    "W2 turn 4, from disk": {"p50": 11.4, "p95": 16.8},
}

# The measured table's "Responses chain" row (Zen 3, shared with other work): mean TTFT of
# turns 2-8, seconds.
RESPONSES_TTFT = {
    "mean TTFT, turns 2-8": {"chained (previous_response_id)": 2.19, "full resend": 2.05,
                             "chat completions": 2.02, "vLLM CPU chained": 2.83},
}  # fmt: skip

# "W3: an agent fleet" (Zen 3): mean TTFT of each turn in seconds, a restart after turn 8.
W3_TTFT = {
    "shoal, KV store in tiers": [25.86, 18.17, 26.08, 21.14, 22.93, 28.13, 33.43, 39.15,
                                 45.46, 43.64],
    "shoal, pool only": [17.71, 15.35, 28.04, 62.03, 73.42, 92.83, 120.79, 136.96, 166.91,
                         161.41],
    "vLLM CPU, prefix caching": [29.92, 20.56, 29.56, 79.38, 104.36, 128.98, 140.10, 176.49,
                                 216.04, 249.76],
}  # fmt: skip

# "Sessions across replicas" (Zen 4): each setup's time over session-affine routing's.
CLUSTER_A = {"total": 78.3, "ttft": 5.43}
CLUSTER = {
    "(a) session-affine + shared tier": {"total": 78.3, "ttft": 5.43},
    "(b) round-robin + shared tier": {"total": 90.3, "ttft": 6.73},
    "(c) round-robin, no tier": {"total": 104.3, "ttft": 9.71},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    out = p.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    plotting.bars(
        out / "w1_throughput.png",
        "W1: 64 requests, SmolLM2-135M, 2 cores of a Zen 4",
        W1_ZEN4,
        "output tokens/s",
    )
    plotting.bars(
        out / "w2_ttft.png", "W2: 16 sessions x 6 turns (Zen 4)", W2_TTFT, "mean TTFT (s)"
    )
    plotting.bars(
        out / "restore_latency.png", "Restoring a session's KV into the pool", RESTORE_MS, "ms"
    )
    plotting.bars(
        out / "responses_chain.png",
        "An agent over the Responses API, 8 turns (Zen 3)",
        RESPONSES_TTFT,
        "seconds",
    )
    plotting.lines(
        out / "w3_fleet.png",
        "W3: 32 agents, full resend, restart after turn 8 (Zen 3)",
        {who: (range(1, len(ttft) + 1), ttft) for who, ttft in W3_TTFT.items()},
        "turn",
        "mean TTFT (s)",
    )
    relative = {
        "total time": {k: v["total"] / CLUSTER_A["total"] for k, v in CLUSTER.items()},
        "mean TTFT, turns 2-6": {k: v["ttft"] / CLUSTER_A["ttft"] for k, v in CLUSTER.items()},
    }
    plotting.bars(
        out / "cluster_sessions.png",
        "W2 through 2 replicas (Zen 4)",
        relative,
        "x session-affine routing's",
    )


if __name__ == "__main__":
    main()
