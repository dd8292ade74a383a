"""Prefill attention: the tiled oneDNN path equals a plain causal softmax reference."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.layers import attention
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
@pytest.mark.parametrize("tile_elems", [1 << 20, 97])
def test_tiled_prefill_matches_reference(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    q_len: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    tile_elems: int,
) -> None:
    """Small tiles split the rows into many causal tiles; large ones keep a single tile."""
    monkeypatch.setattr(attention, "_SCORE_TILE_ELEMS", tile_elems)
    gen = torch.Generator().manual_seed(q_len * 1000 + ctx)
    q = torch.randn(q_len, heads, 16, generator=gen, dtype=dtype)
    keys = torch.randn(ctx, kv_heads, 16, generator=gen, dtype=dtype)
    values = torch.randn(ctx, kv_heads, 16, generator=gen, dtype=dtype)
    out = prefill_attention(q, keys, values, 16**-0.5)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference(q, keys, values), atol=tol, rtol=tol)


def test_sdpa_path_agrees_with_tiled_path() -> None:
    """The path taken off CPU (SDPA with an offset causal mask) computes the same thing."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, 6, 32, generator=gen)
    keys = torch.randn(50, 2, 32, generator=gen)
    values = torch.randn(50, 2, 32, generator=gen)
    for ctx in (20, 50):
        k, v = keys[-ctx:], values[-ctx:]
        torch.testing.assert_close(
            attention._sdpa_prefill(q, k, v, 0.2),
            attention._tiled_prefill(q, k, v, 0.2),
            atol=1e-5,
            rtol=1e-5,
        )


def test_strided_inputs_do_not_change_the_result() -> None:
    """Rows sliced out of a larger batch are strided; the result must not depend on it."""
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(30, 8, 16, generator=gen)
    kv = torch.randn(30, 2, 2, 16, generator=gen)
    keys, values = kv[:, 0], kv[:, 1]
    out = prefill_attention(batch[10:], keys[10:], values[10:], 0.25)
    expected = prefill_attention(batch[10:].clone(), keys[10:].clone(), values[10:].clone(), 0.25)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
