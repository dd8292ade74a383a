"""Which matrix-product path is fastest for the engine's shapes on this CPU?

Compares torch's default `F.linear`, NumPy (OpenBLAS), oneDNN with a prepacked weight and
shoal's own kernel (`shoal/layers/csrc/gemm.cpp`) with a float32 and a bfloat16 weight, on
SmolLM2-135M's projection shapes at decode (64 rows) and prefill (512 rows) sizes, in GFLOP/s
against the CPU's float32 peak.

    .venv/bin/python benchmarks/matmul_backends.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shoal.bench import cpu_info
from shoal.layers import cpu_kernels

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def gflops(fn: Callable[[], object], flop: float, repeat: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return flop / sorted(times)[len(times) // 2] / 1e9


def main() -> None:
    cpu = cpu_info()
    print(f"{cpu.describe()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads")
    print("GFLOP/s (median of 10)")
    names = ["F.linear", "numpy", "oneDNN", "shoal f32", "shoal bf16w"]
    print(f"{'rows':>5} {'in':>5} {'out':>6} " + " ".join(f"{n:>11}" for n in names))
    gemm = cpu_kernels.gemm_available(torch.float32)
    for rows in (64, 512):
        for k, n in SHAPES:
            x, w = torch.randn(rows, k), torch.randn(n, k)
            xn, wt = x.numpy(), w.numpy().T
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            flop = 2.0 * rows * k * n
            fns: list[Callable[[], object] | None] = [
                lambda x=x, w=w: torch.nn.functional.linear(x, w),
                lambda xn=xn, wt=wt: xn @ wt,
                lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                    x, p, None, "none", [], ""
                ),
                None,
                None,
            ]
            if gemm:
                p32, p16 = cpu_kernels.pack_weight(w), cpu_kernels.pack_weight(w.bfloat16())
                fns[3] = lambda x=x, p=p32, n=n: cpu_kernels.gemm(x, p, n, None)
                fns[4] = lambda x=x, p=p16, n=n: cpu_kernels.gemm(x, p, n, None)
            cells = [f"{gflops(f, flop):>11.0f}" if f else f"{'-':>11}" for f in fns]
            print(f"{rows:>5} {k:>5} {n:>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
