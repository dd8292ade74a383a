"""Projections pick oneDNN's packed path only where this CPU runs it, and agree with F.linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal.layers import cpu_kernels, linear


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo")
def test_bfloat16_packing_follows_the_cpu_flags() -> None:
    flags = _cpu_flags()
    # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (its own error message).
    capable = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    if not torch.backends.mkldnn.is_available():
        capable = False
    assert linear.onednn_packs(torch.bfloat16) is capable
    assert linear.onednn_packs(torch.float64) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["gemm", "onednn", "torch"])
def test_linear_matches_f_linear_on_every_path(monkeypatch, dtype, path) -> None:
    if path == "gemm" and not cpu_kernels.gemm_available(dtype):
        pytest.skip("no AVX2 + FMA or no compiler")
    if path == "onednn" and not linear.onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    monkeypatch.setattr(cpu_kernels, "gemm_available", lambda d: path == "gemm")
    monkeypatch.setattr(linear, "onednn_usable", lambda w: path == "onednn")
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    layer = linear.Linear(w.to(dtype), b.to(dtype))
    # The kernel takes float32 activations against either weight; the others match dtypes.
    got = layer(x if path == "gemm" else x.to(dtype))
    assert got.dtype == (torch.float32 if path == "gemm" else dtype)
    assert (layer._panels is not None) is (path == "gemm")
    assert (layer._packed is not None) is (path == "onednn")
    tol = 1e-4 if dtype == torch.float32 or path == "gemm" else 0.15
    ref_w = w.to(dtype).float() if path == "gemm" else w
    torch.testing.assert_close(
        got.float(), F.linear(x, ref_w, b.to(dtype).float()), atol=tol, rtol=tol
    )
