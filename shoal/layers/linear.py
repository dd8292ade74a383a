"""Dense projections, each through the fastest path this CPU runs correctly.

- AVX-512 CPUs, float32 x float32, and bfloat16 x bfloat16 where the CPU has AVX512_BF16 but
  no AMX: shoal's own kernel (`csrc/gemm512.cpp`; bfloat16 through VDPBF16PS, the weight
  packed in k-pairs, at about twice the float32 rate). On the engine's shapes it matches oneDNN
  in float32 and beats it by 5-10% in bfloat16 on a Zen 4 core, and it fuses what follows the
  gate-up product (`GateUpProjection`), which oneDNN's packed path cannot.
- float32 activations on an AVX2 + FMA CPU without AVX-512: shoal's own kernel
  (`csrc/gemm.cpp`) against a float32 or bfloat16 weight packed once into 16-column panels: on
  the engine's small-K shapes it ran closer to a Zen 3's peak than oneDNN, and it is the only
  fast bfloat16-weight path on CPUs without native bfloat16 (`benchmarks/matmul_backends.py`).
- bfloat16 x bfloat16 elsewhere (AMX, whose tiles oneDNN drives; Arm): oneDNN's packed path.
- Elsewhere `F.linear`. oneDNN's packed bfloat16 path needs AVX512-BW/VL/DQ or AVX-NE-CONVERT
  and raises on CPUs without them, so whether it runs is probed once per dtype.

Staying inside torch's thread pool matters on a small machine: mixing OpenBLAS's spinning
threads with torch's OpenMP threads stalled both.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shoal.layers import cpu_kernels, weight_packing
from shoal.layers.cpu_features import has_amx, native_bf16

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
    """How CPU products of these dtypes run: "gemm512" (shoal's AVX-512 kernel), "gemm"
    (shoal's AVX2 kernel, float32 activations), "onednn" or "torch"."""
    kernels = cpu_kernels.native()
    # oneDNN drives AMX tiles, far faster than any VDPBF16PS kernel, where the CPU has them.
    amx_bf16 = act == torch.bfloat16 and has_amx()
    if kernels is not None and act == weight and kernels.has_gemm512(act) and not amx_bf16:
        return "gemm512"
    if act == torch.float32 and kernels is not None and kernels.has_gemm(weight):
        return "gemm"
    if act == weight and onednn_packs(weight):
        return "onednn"
    return "torch"


def _pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


_PACKERS = {
    "gemm": weight_packing.pack_weight,
    "gemm512": weight_packing.pack_for_gemm512,
    "onednn": _pack_onednn,
}


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # The weight (and bias) in the layout of `_packed_for`: each layer only takes one path.
        self._packed: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._packed_for = ""

    def _pack(self, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight in `path`'s layout and the bias as shoal's kernels add it (float32,
        zero-padded to whole panels; oneDNN takes the layer's own)."""
        bias = None if path == "onednn" else weight_packing.pack_bias(self.bias)
        return _PACKERS[path](self.weight.detach()), bias

    def _packed_weight(self, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._packed is None or self._packed_for != path:
            self._packed, self._packed_for = self._pack(path), path
        return self._packed

    def _path(self, x: torch.Tensor) -> str:
        w = self.weight
        path = projection_path(x.dtype, w.dtype) if x.device.type == "cpu" else "torch"
        if path == "gemm512" and w.dtype == torch.bfloat16 and w.shape[1] % 2:
            path = "onednn" if onednn_packs(w.dtype) else "torch"  # the kernel takes k in pairs
        return path

    def _product(self, x: torch.Tensor, path: str, silu: bool = False) -> torch.Tensor:
        """x through shoal's kernel or oneDNN (`path`), `silu` only with "gemm512"."""
        packed, bias = self._packed_weight(path)
        if path == "onednn":
            # A strided operand takes oneDNN's reference path, about 1000x slower.
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), packed, self.bias, "none", [], ""
            )
        kernels = cpu_kernels.native()
        assert kernels is not None
        n, k = self.weight.shape
        rows = x.reshape(-1, k)
        if path == "gemm":
            out = kernels.gemm(rows, packed, n, bias)
        else:
            n = n // 2 if silu else n
            out = kernels.gemm512(rows, packed, n, bias, silu=silu)
        return out.view(*x.shape[:-1], n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self._path(x)
        if path == "torch":
            return nn.functional.linear(x, self.weight, self.bias)
        return self._product(x, path)


class GateUpProjection(Linear):
    """A gated MLP's gate and up projections in one product (weight `[gate; up]`), returning
    silu(gate) * up: inside the product's epilogue on the AVX-512 kernel (the `[tokens, 2 x
    intermediate]` product is never written out), else one C++ pass or torch after it."""

    def _pack(self, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if path == "gemm512":
            return weight_packing.pack_gate_up(self.weight.detach(), self.bias)
        return super()._pack(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self._path(x)
        if path == "gemm512":
            return self._product(x, path, silu=True)
        gate_up = super().forward(x)
        kernels = cpu_kernels.for_tensor(gate_up)
        if kernels is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        # In place, on the product's own output: two fewer [tokens, intermediate] temporaries.
        return nn.functional.silu(gate, inplace=True).mul_(up)
