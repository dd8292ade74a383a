"""Projections pick oneDNN's packed path only where this CPU runs it, and agree with F.linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal.layers import cpu_kernels, linear
from shoal.layers.cpu_features import cpu_flags, has_amx


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo")
def test_bfloat16_packing_follows_the_cpu_flags() -> None:
    flags = cpu_flags()
    # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (its own error message).
    capable = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    if not torch.backends.mkldnn.is_available():
        capable = False
    assert linear.onednn_packs(torch.bfloat16) is capable
    assert linear.onednn_packs(torch.float64) is False


def test_projection_path_follows_the_cpu() -> None:
    kernels = cpu_kernels.native()
    f32 = linear.projection_path(torch.float32, torch.float32)
    if kernels is not None and kernels.has_gemm512(torch.float32):
        assert f32 == "gemm512"  # AVX-512: shoal's kernel (the gate-up epilogue fuses SiLU)
    elif kernels is not None and kernels.has_gemm(torch.float32):
        assert f32 == "gemm"  # AVX2 + FMA without AVX-512
    elif linear.onednn_packs(torch.float32):
        assert f32 == "onednn"
    bf16 = linear.projection_path(torch.bfloat16, torch.bfloat16)
    if kernels is not None and kernels.has_gemm512(torch.bfloat16) and not has_amx():
        assert bf16 == "gemm512"  # AVX512_BF16 without AMX: shoal's VDPBF16PS kernel
    else:
        assert bf16 == ("onednn" if linear.onednn_packs(torch.bfloat16) else "torch")
    if kernels is not None and kernels.has_gemm(torch.bfloat16):
        assert linear.projection_path(torch.float32, torch.bfloat16) == "gemm"


_NEEDS = {
    "gemm": "shoal's AVX2 kernel needs AVX2 + FMA and a compiler",
    "gemm512": "shoal's AVX-512 kernel needs AVX-512 (AVX512_BF16 for bfloat16) and a compiler",
}


def _take(monkeypatch: pytest.MonkeyPatch, path: str, dtype: torch.dtype) -> None:
    """Make every projection take `path`, or skip where this CPU cannot run it."""
    kernels = cpu_kernels.native()
    runs = {
        "gemm": kernels is not None and kernels.has_gemm(dtype),
        "gemm512": kernels is not None and kernels.has_gemm512(dtype),
    }
    if not runs.get(path, True):
        pytest.skip(_NEEDS[path])
    if path == "onednn" and not linear.onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    monkeypatch.setattr(linear, "projection_path", lambda act, weight: path)


_PATHS = ["gemm", "gemm512", "onednn", "torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", _PATHS)
@pytest.mark.parametrize("k", [40, 41])  # the VDPBF16PS kernel takes k in pairs
def test_linear_matches_float64_on_every_path(monkeypatch, dtype, path, k) -> None:
    _take(monkeypatch, path, dtype)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, k, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(5, k, generator=gen)
    layer = linear.Linear(w.to(dtype), b.to(dtype))
    # The AVX2 kernel takes float32 activations against either weight; the others match dtypes.
    x_in = x if path == "gemm" else x.to(dtype)
    got = layer(x_in)
    assert got.dtype == (torch.float32 if path == "gemm" else dtype)
    taken = path
    if path == "gemm512" and dtype == torch.bfloat16 and k % 2:  # odd k: oneDNN (or torch)
        taken = "onednn" if linear.onednn_packs(dtype) else "torch"
    assert layer._packed_for == ("" if taken == "torch" else taken)
    # Against float64 math on the same (rounded) operands; bf16 outputs are rounded once.
    expected = F.linear(x_in.double(), w.to(dtype).double(), b.to(dtype).double())
    tol = 1e-5 if got.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", _PATHS)
def test_gate_up_projection_is_silu_gate_times_up_on_every_path(monkeypatch, dtype, path) -> None:
    """24 intermediate columns: each half ends in a partial panel."""
    _take(monkeypatch, path, dtype)
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(7, 40, generator=gen)
    x_in = x if path == "gemm" else x.to(dtype)
    got = linear.GateUpProjection(w.to(dtype), b.to(dtype))(x_in)
    gate, up = F.linear(x_in.double(), w.to(dtype).double(), b.to(dtype).double()).chunk(2, -1)
    tol = 1e-5 if got.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), F.silu(gate) * up, atol=tol, rtol=tol)
