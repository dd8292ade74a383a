"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

On the CPU the C++ kernel (`csrc/elementwise.cpp`) reads and writes each row once; elsewhere,
half-precision inputs are normalized in float32 like the reference implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.for_tensor(x)
        if kernels is not None and self.weight.dtype == x.dtype:
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        if dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`; the sum may be written into `residual`."""
        kernels = cpu_kernels.for_tensor(x)
        if kernels is not None and self.weight.dtype == x.dtype and residual.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self.forward(residual), residual
