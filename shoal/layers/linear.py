"""Dense projections.

On CPU, float32 and bfloat16 products run through oneDNN with the weight packed once into its
blocked layout, where this CPU supports it. On the reference 2-core AMD machine torch's default
path (MKL) ran the engine's shapes (64 x 576 by 576 x 1536) at 7 to 90 GFLOP/s and NumPy's
OpenBLAS at about 100 per core, while packed oneDNN reached about 200 per core
(`benchmarks/matmul_backends.py`). Staying inside torch also keeps a single thread pool:
mixing OpenBLAS's spinning threads with torch's OpenMP threads stalled both.

oneDNN's packed bfloat16 path needs AVX512-BW/VL/DQ or AVX-NE-CONVERT and raises on CPUs
without them (an AVX2-only Zen 3, say), so whether it runs is probed once per dtype by
packing and running a tiny product; where it does not, `F.linear` is used.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

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
        self._packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or not onednn_usable(self.weight):
            return nn.functional.linear(x, self.weight, self.bias)
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
