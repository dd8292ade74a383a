"""Which matrix-product path is fastest for the engine's shapes on this CPU?

Compares torch's default `F.linear`, NumPy (OpenBLAS) and oneDNN with a prepacked weight, on
SmolLM2-135M's projection shapes at decode (64 rows) and prefill (512 rows) sizes.

    .venv/bin/python benchmarks/matmul_backends.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SHAPES = [(576, 1728), (576, 3072), (1536, 576), (576, 576), (576, 49152)]


def gflops(fn: Callable[[], object], flop: float, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return flop / sorted(times)[len(times) // 2] / 1e9


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s (median)")
    print(f"{'rows':>5} {'in':>5} {'out':>6} {'F.linear':>9} {'numpy':>7} {'oneDNN':>7}")
    for rows in (64, 512):
        for k, n in SHAPES:
            x, w = torch.randn(rows, k), torch.randn(n, k)
            xn, wt = x.numpy(), w.numpy().T
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            flop = 2.0 * rows * k * n
            results = [
                gflops(lambda x=x, w=w: torch.nn.functional.linear(x, w), flop),
                gflops(lambda xn=xn, wt=wt: xn @ wt, flop),
                gflops(
                    lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""
                    ),
                    flop,
                ),
            ]
            print(f"{rows:>5} {k:>5} {n:>6} " + " ".join(f"{r:>8.0f}" for r in results))


if __name__ == "__main__":
    main()
