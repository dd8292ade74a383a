"""Dense projections.

On an AVX2 + FMA CPU with a C++ compiler, float32 activations meet a float32 or bfloat16
weight in shoal's own kernel (`csrc/gemm.cpp`), the weight packed once into 16-column panels:
on the engine's small-K shapes it runs closer to the CPU's peak than oneDNN, and it is the only
fast bfloat16-weight path on CPUs without AVX512-BF16 (`benchmarks/matmul_backends.py`).
Elsewhere float32 and bfloat16 products run through oneDNN with the weight packed once into
its blocked layout, where the CPU supports it: oneDNN's packed bfloat16 path needs
AVX512-BW/VL/DQ or AVX-NE-CONVERT and raises on CPUs without them (an AVX2-only Zen 3, say),
so whether it runs is probed once per dtype by packing and running a tiny product; where it
does not, `F.linear` is used. Staying inside torch's thread pool matters on a small machine:
mixing OpenBLAS's spinning threads with torch's OpenMP threads stalled both.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shoal.layers import cpu_kernels

_PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs `dtype` products on this CPU (probed once)."""
    if dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 1)
        x = torch.ones(1, 16, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(out.eq(16).all())


def onednn_usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and onednn_packs(weight.dtype)


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b.T` for 2-D tensors through oneDNN where usable: attention's two products.

    oneDNN takes a strided operand through a reference path about 1000x slower, so both are made
    contiguous first (a no-op when they are).
    """
    if a.dtype != b.dtype or not onednn_usable(b):
        return nn.functional.linear(a, b)
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), None, "none", [], "")


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._packed: torch.Tensor | None = None  # oneDNN's layout
        self._panels: torch.Tensor | None = None  # gemm.cpp's layout
        self._bias32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and cpu_kernels.gemm_available(w.dtype)
        ):
            if self._panels is None:
                self._panels = cpu_kernels.pack_weight(w.detach())
                self._bias32 = None if self.bias is None else self.bias.detach().float()
            rows = x.reshape(-1, x.shape[-1])
            out = cpu_kernels.gemm(rows, self._panels, w.shape[0], self._bias32)
            return out.view(*x.shape[:-1], w.shape[0])
        if x.dtype != self.weight.dtype or not onednn_usable(self.weight):
            return nn.functional.linear(x, self.weight, self.bias)
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        # A strided operand takes oneDNN's reference path, about 1000x slower.
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, self.bias, "none", [], ""
        )
