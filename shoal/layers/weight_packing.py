"""Weights in the layouts shoal's product kernels read (`csrc/gemm.cpp`, `csrc/gemm512.cpp`),
packed once per layer by `Linear` and kept beside the weight.

Every layout is panels of 16 output columns (a vector of float32 accumulators each), rows
zero-padded to whole panels, so a kernel reads consecutive memory along k.
"""

from __future__ import annotations

import torch

PANEL = 16  # output columns per packed weight panel (the kernels' NR)


def _pad_rows(weight: torch.Tensor) -> torch.Tensor:
    pad = -weight.shape[0] % PANEL
    return torch.cat([weight, weight.new_zeros(pad, *weight.shape[1:])]) if pad else weight


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> `[ceil(N / 16), K, 16]`: panels of 16 output columns, k-major, zero-padded."""
    k = weight.shape[1]
    return _pad_rows(weight).reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def pack_weight_pairs(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` bfloat16 -> `[ceil(N / 16), K / 2, 16, 2]`: panels of 16 output columns, k in
    pairs (the layout VDPBF16PS multiplies), zero-padded columns. K must be even."""
    k = weight.shape[1]
    assert k % 2 == 0, "pairs of k"
    return _pad_rows(weight).reshape(-1, PANEL, k // 2, 2).transpose(1, 2).contiguous()


def pack_for_gemm512(weight: torch.Tensor) -> torch.Tensor:
    """The AVX-512 kernel's layout for a weight of its dtype (float32 or bfloat16)."""
    return pack_weight_pairs(weight) if weight.dtype == torch.bfloat16 else pack_weight(weight)


def pack_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the AVX-512 kernel reads it: float32, zero-padded to whole panels."""
    return None if bias is None else _pad_rows(bias.detach().float())


def pack_gate_up(
    weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A `[2N, K]` gate-up weight (gate rows first) packed for `gemm512(..., silu=True)`: gate
    panel q, then up panel q; the bias (if any) in the same order."""
    gate, up = weight.chunk(2)
    packed = torch.stack([pack_for_gemm512(gate), pack_for_gemm512(up)], 1).flatten(0, 1)
    if bias is None:
        return packed, None
    halves = [_pad_rows(h.detach().float()).view(-1, PANEL) for h in bias.chunk(2)]
    return packed, torch.stack(halves, 1).flatten()
