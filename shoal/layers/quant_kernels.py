"""Typed entry points of the quantized products (`csrc/quantize.cpp`, `csrc/qgemm.cpp`) over
one build of the kernel library: float32 rows are quantized to int8 blocks, then multiplied
with a weight kept in its quantized blocks (`quant_formats`)."""

from __future__ import annotations

import ctypes

import torch

from shoal.layers.cpu_kernels import CpuKernels, _product_out
from shoal.layers.kernel_abi import QGEMM
from shoal.layers.quant_formats import BLOCK, QuantizedWeight


def isa(kernels: CpuKernels) -> str:
    """The integer dot product this build's quantized products use: "avx512vnni",
    "avxvnni", "avx2" (VPMADDUBSW) or "generic" (portable loops)."""
    fn = kernels.lib.shoal_qgemm_isa
    fn.restype = ctypes.c_char_p
    return str(fn().decode())


def quantize_rows(kernels: CpuKernels, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows `[m, k]` (k a multiple of 32) as int8 `[m, k]` and, per block of 32,
    `(scale, scale * sum of the block's int8 values)`: `[m, k / 32, 2]` float32."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    blocks = torch.empty(m, k // BLOCK, 2, dtype=torch.float32)
    kernels.lib.quantize_rows_q8(
        x.data_ptr(), x.stride(0), m, k, q.data_ptr(), blocks.data_ptr(), torch.get_num_threads()
    )
    return q, blocks


def qgemm(
    kernels: CpuKernels,
    q: torch.Tensor,
    blocks: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for rows quantized by `quantize_rows`: float32 `[m, n]`."""
    m, k = q.shape
    assert k == weight.k and q.is_contiguous() and blocks.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    out = _product_out(m, weight.n, torch.float32)
    getattr(kernels.lib, QGEMM[weight.fmt.name])(
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
