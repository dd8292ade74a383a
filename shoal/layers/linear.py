"""Dense projections.

On CPU, float32/float64 products go through NumPy's OpenBLAS: on the reference machine torch's
MKL path ran the engine's typical shapes (64 x 576 by 576 x 1536) at a half to a tenth of
OpenBLAS's speed (see benchmarks/matmul_backends.py). Both views share memory, nothing is copied.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

_NUMPY_DTYPES = (torch.float32, torch.float64)


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._weight_t: np.ndarray | None = None

    def _use_numpy(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and x.dtype == self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._use_numpy(x):
            return nn.functional.linear(x, self.weight, self.bias)
        if self._weight_t is None:
            self._weight_t = self.weight.detach().numpy().T
        out = torch.from_numpy(np.matmul(x.detach().contiguous().numpy(), self._weight_t))
        if self.bias is not None:
            out += self.bias
        return out
