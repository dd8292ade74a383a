"""Which matrix-product path is fastest for the engine's shapes on this CPU?

Compares torch's default `F.linear`, NumPy (OpenBLAS), oneDNN with a prepacked weight (float32,
and bfloat16 x bfloat16, which runs VDPBF16PS or AMX where the CPU has them) and shoal's own
kernels: `shoal/layers/csrc/gemm.cpp` (AVX2 + FMA) with a float32 and a bfloat16 weight, and
`gemm512.cpp` (AVX-512: float32, and bfloat16 x bfloat16 through VDPBF16PS) where it runs, on
SmolLM2-135M's projection shapes at decode (64 rows) and prefill (512 rows) sizes, in GFLOP/s
against the CPU's float32 peak (bfloat16 dot products peak at twice that).

    .venv/bin/python benchmarks/matmul_backends.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shoal.bench import cpu_info
from shoal.layers import cpu_kernels, linear, weight_packing

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
    names = ["F.linear", "numpy", "oneDNN", "oneDNN bf16", "shoal f32", "shoal bf16w"]
    names += ["shoal512 f32", "shoal512 bf16"]
    print(f"{'rows':>5} {'in':>5} {'out':>6} " + " ".join(f"{n:>11}" for n in names))
    kernels = cpu_kernels.native()
    gemm = kernels is not None and kernels.has_gemm(torch.float32)
    wide = [dt for dt in (torch.float32, torch.bfloat16) if kernels and kernels.has_gemm512(dt)]
    bf16 = linear.onednn_packs(torch.bfloat16)
    for rows in (64, 512):
        for k, n in SHAPES:
            x, w = torch.randn(rows, k), torch.randn(n, k)
            xn, wt = x.numpy(), w.numpy().T
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            xb, wb = x.bfloat16(), w.bfloat16()
            packed16 = torch.ops.mkldnn._reorder_linear_weight(wb, rows) if bf16 else None
            flop = 2.0 * rows * k * n
            fns: list[Callable[[], object] | None] = [
                lambda x=x, w=w: torch.nn.functional.linear(x, w),
                lambda xn=xn, wt=wt: xn @ wt,
                lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                    x, p, None, "none", [], ""
                ),
                None,
                None,
                None,
                None,
                None,
            ]
            if packed16 is not None:
                fns[3] = lambda x=xb, p=packed16: torch.ops.mkldnn._linear_pointwise(
                    x, p, None, "none", [], ""
                )
            if gemm and kernels is not None:
                p32, p16 = weight_packing.pack_weight(w), weight_packing.pack_weight(wb)
                fns[4] = lambda x=x, p=p32, n=n, k=kernels: k.gemm(x, p, n, None)
                fns[5] = lambda x=x, p=p16, n=n, k=kernels: k.gemm(x, p, n, None)
            for col, dt in ((6, torch.float32), (7, torch.bfloat16)):
                if dt in wide and kernels is not None:
                    xd, p512 = x.to(dt), weight_packing.pack_for_gemm512(w.to(dt))
                    fns[col] = lambda x=xd, p=p512, n=n, k=kernels: k.gemm512(x, p, n, None)
            cells = [f"{gflops(f, flop):>11.0f}" if f else f"{'-':>11}" for f in fns]
            print(f"{rows:>5} {k:>5} {n:>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
