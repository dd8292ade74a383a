"""Dense projections, each through the fastest path this CPU runs correctly.

- bfloat16 activations x bfloat16 weights (CPUs with native bfloat16 dot products, see
  `cpu_features`): oneDNN's packed path, which runs VDPBF16PS or AMX tiles, accumulating in
  float32; about twice the float32 rate on a Zen 4.
- float32 activations on an AVX2 + FMA CPU without AVX-512: shoal's own kernel
  (`csrc/gemm.cpp`) against a float32 or bfloat16 weight packed once into 16-column panels: on
  the engine's small-K shapes it ran closer to a Zen 3's peak than oneDNN, and it is the only
  fast bfloat16-weight path on CPUs without native bfloat16 (`benchmarks/matmul_backends.py`).
- float32 on AVX-512 CPUs: oneDNN's packed path (its `avx512_core` kernels).
- Elsewhere `F.linear`. oneDNN's packed bfloat16 path needs AVX512-BW/VL/DQ or AVX-NE-CONVERT
  and raises on CPUs without them, so whether it runs is probed once per dtype.

Staying inside torch's thread pool matters on a small machine: mixing OpenBLAS's spinning
threads with torch's OpenMP threads stalled both.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shoal.layers import cpu_kernels
from shoal.layers.cpu_features import has_avx512, native_bf16

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


def native_bf16_products() -> bool:
    """Whether bfloat16 x bfloat16 products run natively here: oneDNN's packed path on a CPU
    with bfloat16 dot-product instructions (then bfloat16 models keep bfloat16 activations)."""
    return native_bf16() and onednn_packs(torch.bfloat16)


@functools.cache
def projection_path(act: torch.dtype, weight: torch.dtype) -> str:
    """How CPU products of these dtypes run: "gemm" (shoal's kernel), "onednn" or "torch"."""
    kernels = cpu_kernels.native()
    gemm = act == torch.float32 and kernels is not None and kernels.has_gemm(weight)
    # On AVX-512 CPUs oneDNN's own float32 kernels are as fast or faster.
    if gemm and (weight != torch.float32 or not (has_avx512() and onednn_packs(weight))):
        return "gemm"
    if act == weight and onednn_packs(weight):
        return "onednn"
    return "torch"


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
        path = projection_path(x.dtype, w.dtype) if x.device.type == "cpu" else "torch"
        if path == "gemm":
            kernels = cpu_kernels.native()
            assert kernels is not None
            if self._panels is None:
                self._panels = cpu_kernels.pack_weight(w.detach())
                self._bias32 = None if self.bias is None else self.bias.detach().float()
            rows = x.reshape(-1, x.shape[-1])
            out = kernels.gemm(rows, self._panels, w.shape[0], self._bias32)
            return out.view(*x.shape[:-1], w.shape[0])
        if path == "torch":
            return nn.functional.linear(x, w, self.bias)
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
        # A strided operand takes oneDNN's reference path, about 1000x slower.
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, self.bias, "none", [], ""
        )
