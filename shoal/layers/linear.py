"""Dense projections, each through the fastest path this CPU runs correctly.

- bfloat16 activations x bfloat16 weights (CPUs with native bfloat16 dot products, see
  `cpu_features`): with AVX512_BF16, shoal's own VDPBF16PS kernel (`csrc/gemm_bf16.cpp`, the
  weight packed in k-pairs; 5-10% over oneDNN on the engine's shapes on a Zen 4 core), unless
  the CPU has AMX, whose tiles oneDNN drives; elsewhere oneDNN's packed path. All accumulate in
  float32, at about twice the float32 rate or more.
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
from shoal.layers.cpu_features import has_amx, has_avx512, native_bf16

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
    """How CPU products of these dtypes run: "gemm" (shoal's AVX2 kernel, float32 activations),
    "gemm-bf16" (shoal's VDPBF16PS kernel), "onednn" or "torch"."""
    kernels = cpu_kernels.native()
    gemm = act == torch.float32 and kernels is not None and kernels.has_gemm(weight)
    # On AVX-512 CPUs oneDNN's own float32 kernels are as fast or faster.
    if gemm and (weight != torch.float32 or not (has_avx512() and onednn_packs(weight))):
        return "gemm"
    # oneDNN drives AMX tiles, far faster than any VDPBF16PS kernel, where the CPU has them.
    own_bf16 = kernels is not None and kernels.has_bf16_gemm() and not has_amx()
    if act == weight == torch.bfloat16 and own_bf16:
        return "gemm-bf16"
    if act == weight and onednn_packs(weight):
        return "onednn"
    return "torch"


def _pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


_PACKERS = {
    "gemm": cpu_kernels.pack_weight,
    "gemm-bf16": cpu_kernels.pack_weight_pairs,
    "onednn": _pack_onednn,
}


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._packed: torch.Tensor | None = None  # the weight in the layout of `_packed_for`
        self._packed_for = ""
        self._bias32: torch.Tensor | None = None  # shoal's kernels add a float32 bias

    def _packed_weight(self, path: str) -> torch.Tensor:
        """The weight packed once for `path` (each layer only ever takes one path)."""
        if self._packed is None or self._packed_for != path:
            self._packed = _PACKERS[path](self.weight.detach())
            self._packed_for = path
            self._bias32 = None if self.bias is None else self.bias.detach().float()
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        n, k = w.shape
        path = projection_path(x.dtype, w.dtype) if x.device.type == "cpu" else "torch"
        if path == "gemm-bf16" and k % 2:  # the kernel takes k in pairs
            path = "onednn" if onednn_packs(w.dtype) else "torch"
        if path == "torch":
            return nn.functional.linear(x, w, self.bias)
        packed = self._packed_weight(path)
        if path == "onednn":
            # A strided operand takes oneDNN's reference path, about 1000x slower.
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), packed, self.bias, "none", [], ""
            )
        kernels = cpu_kernels.native()
        assert kernels is not None
        rows = x.reshape(-1, k)
        gemm = kernels.gemm if path == "gemm" else kernels.gemm_bf16
        return gemm(rows, packed, n, self._bias32).view(*x.shape[:-1], n)
