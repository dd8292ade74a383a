"""Typed entry points of the quantized products (`csrc/quantize.cpp`, `csrc/qgemm.cpp`) over
one build of the kernel library: float32 rows are quantized to int8 blocks, then multiplied
with a weight kept in its quantized blocks (`quant_formats`)."""

from __future__ import annotations

import ctypes

import torch

from shoal.layers.cpu_kernels import CpuKernels, _product_out
from shoal.layers.quant_formats import BLOCK, FORMAT_IDS, QuantizedWeight


def isa(kernels: CpuKernels) -> str:
    """The integer dot product this build's quantized products use: "avx512vnni" or
    "avxvnni" (VPDPBUSD), "avx2" (VPMADDUBSW) or "generic" (portable loops)."""
    fn = kernels.lib.shoal_qgemm_isa
    fn.restype = ctypes.c_char_p
    return str(fn().decode())


def quantize_rows(
    kernels: CpuKernels, x: torch.Tensor, levels: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows `[m, k]` (k a multiple of 32) in blocks of 32 with `levels` int8 levels
    (`csrc/quantize.cpp`): int8 `[m, levels * k]` and, per block, `(scale, scale * the sum of
    the block's values in units of the scale)`, `[m, k / 32, 2]` float32."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty(m, levels * k, dtype=torch.int8)
    blocks = torch.empty(m, k // BLOCK, 2, dtype=torch.float32)
    kernels.lib.quantize_rows(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        levels,
        q.data_ptr(),
        blocks.data_ptr(),
        torch.get_num_threads(),
    )
    return q, blocks


def dequantize_rows(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The float64 values rows quantized by `quantize_rows` stand for (the tests' reference)."""
    m, nb = blocks.shape[:2]
    levels = q.shape[1] // (nb * BLOCK)
    units = q.view(m, nb, levels, BLOCK).double()
    if levels == 2:
        units = 254 * units[:, :, 0] + units[:, :, 1]
    return (units.view(m, nb, BLOCK) * blocks[..., :1].double()).view(m, nb * BLOCK)


def qgemm(
    kernels: CpuKernels,
    q: torch.Tensor,
    blocks: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for rows quantized by `quantize_rows`: float32 `[m, n]`."""
    m, k = q.shape[0], weight.k
    assert q.shape[1] % k == 0 and q.is_contiguous() and blocks.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    out = _product_out(m, weight.n, torch.float32)
    kernels.lib.qgemm(
        FORMAT_IDS[weight.fmt.name],
        q.shape[1] // k,
        q.data_ptr(),
        blocks.data_ptr(),
        m,
        k,
        weight.data.data_ptr(),
        weight.n,
        out.data_ptr(),
        out.stride(0),
        None if bias is None else bias.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def dequantizing_gemm(
    kernels: CpuKernels, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for float32 rows through the float32 kernel, the weight dequantized
    a panel of 16 columns at a time (`csrc/dequant_panel.h`; AVX2 builds, `has_gemm`)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    m, k = x.shape
    out = _product_out(m, weight.n, torch.float32)
    kernels.lib.gemm_quant(
        x.data_ptr(),
        m,
        k,
        x.stride(0),
        FORMAT_IDS[weight.fmt.name],
        weight.data.data_ptr(),
        weight.n,
        out.data_ptr(),
        out.stride(0),
        None if bias is None else bias.data_ptr(),
        torch.get_num_threads(),
    )
    return out
