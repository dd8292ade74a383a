"""Prefill attention: both CPU paths (tiled oneDNN products, SDPA) equal a plain causal softmax."""

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
@pytest.mark.parametrize("path", ["tiled", "sdpa"])
def test_prefill_matches_reference(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    q_len: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    tile_elems: int,
    path: str,
) -> None:
    """Small tiles split the rows into many causal tiles; large ones keep a single tile."""
    monkeypatch.setattr(attention, "_SCORE_TILE_ELEMS", tile_elems)
    monkeypatch.setattr(attention, "_MIN_TILED_PAIRS", 0 if path == "tiled" else 1 << 62)
    gen = torch.Generator().manual_seed(q_len * 1000 + ctx)
    q = torch.randn(q_len, heads, 16, generator=gen, dtype=dtype)
    keys = torch.randn(ctx, kv_heads, 16, generator=gen, dtype=dtype)
    values = torch.randn(ctx, kv_heads, 16, generator=gen, dtype=dtype)
    out = prefill_attention(q, keys, values, 16**-0.5)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference(q, keys, values), atol=tol, rtol=tol)


def test_strided_inputs_do_not_change_the_result() -> None:
    """Rows sliced out of a larger batch are strided; oneDNN's products must not see it."""
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(30, 8, 16, generator=gen)
    kv = torch.randn(30, 2, 2, 16, generator=gen)
    keys, values = kv[:, 0], kv[:, 1]
    tiled = attention._tiled_prefill
    out = tiled(batch[10:], keys[10:], values[10:], 0.25)
    expected = tiled(batch[10:].clone(), keys[10:].clone(), values[10:].clone(), 0.25)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
