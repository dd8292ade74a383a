"""The torch prefill path (SDPA, used on CUDA and without a C++ compiler) equals a plain causal
softmax; the C++ kernels are checked against float64 in test_cpu_kernels."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.layers import attention, cpu_kernels
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


@pytest.mark.parametrize("bf16_tiles", [True, False])
def test_bf16_batch_through_either_prefill_tiles(
    bf16_tiles: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 step of two decodes and two prefill chunks (one after cached context) equals
    float64 attention whichever tiles the CPU's policy picks: bfloat16 tiles (AMX on this CPU
    if it has it, else VDPBF16PS) or float32 tiles over the bfloat16 cache, which must leave the
    decodes' rows as the decode wrote them."""
    kernels = cpu_kernels.native()
    if kernels is None or not kernels.prefills(torch.bfloat16, torch.bfloat16):
        pytest.skip("this build has no bfloat16 C++ attention (needs AVX-512 or AVX2)")
    monkeypatch.setattr(attention, "bf16_prefill_tiles", lambda *_: bf16_tiles)
    gen = torch.Generator().manual_seed(5)
    block, heads, kv_heads, dim = 16, 9, 3, 64
    k_cache, v_cache = (
        torch.randn(32, block, kv_heads, dim, generator=gen).bfloat16() for _ in range(2)
    )
    tables = torch.randperm(32, generator=gen)[:24].view(4, 6)  # 96 positions a sequence
    # (query rows, context): decodes of 40 and 7 tokens, chunks of 30 new and 20 after 50.
    rows = [(1, 40), (1, 7), (30, 30), (20, 70)]
    q = torch.randn(sum(n for n, _ in rows), heads, dim, generator=gen).bfloat16()
    spans = torch.tensor([[2, 30, 30], [32, 20, 70]])
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decodes=2,
        decode_block_tables=tables[:2],
        decode_lens=torch.tensor([40, 7]),
        prefills=[
            attention.PrefillChunk(2, 30, 30, tables[2]),
            attention.PrefillChunk(32, 20, 70, tables[3]),
        ],
        prefill_spans=spans,
        prefill_tables=tables[2:],
    )
    out = attention.paged_attention(
        q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, meta, 0.125
    )
    start = 0
    for (n, ctx), table in zip(rows, tables, strict=True):
        keys = k_cache[table].flatten(0, 1)[:ctx]
        values = v_cache[table].flatten(0, 1)[:ctx]
        want = reference(q[start : start + n], keys, values)  # scale 0.125 = dim ** -0.5
        torch.testing.assert_close(out[start : start + n].double(), want, atol=2e-2, rtol=2e-2)
        start += n
