"""The torch prefill path (SDPA, used on CUDA and without a C++ compiler) equals a plain causal
softmax; the C++ kernels are checked against float64 in test_cpu_kernels."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.layers.attention import prefill_attention


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Textbook attention in float64: query i (position C - L + i) sees keys 0..C - L + i."""
    q_len, heads, dim = q.shape
    ctx, kv_heads = keys.shape[:2]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) / math.sqrt(dim)
    future = torch.arange(ctx)[None, :] > torch.arange(ctx - q_len, ctx)[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hlc,chd->lhd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("q_len", "ctx", "heads", "kv_heads"),
    [(1, 1, 4, 4), (7, 7, 4, 2), (37, 37, 9, 3), (5, 90, 6, 3), (40, 103, 8, 1), (64, 64, 4, 4)],
)
def test_prefill_matches_reference(
    dtype: torch.dtype, q_len: int, ctx: int, heads: int, kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(q_len * 1000 + ctx)
    q = torch.randn(q_len, heads, 16, generator=gen, dtype=dtype)
    keys = torch.randn(ctx, kv_heads, 16, generator=gen, dtype=dtype)
    values = torch.randn(ctx, kv_heads, 16, generator=gen, dtype=dtype)
    out = prefill_attention(q, keys, values, 16**-0.5)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference(q, keys, values), atol=tol, rtol=tol)
