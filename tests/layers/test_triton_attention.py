"""The Triton paged-attention kernel equals float64 attention over the same blocks: decodes of
many lengths over their block tables, and prefill chunks (after cached context, beside decodes
in one batch) with their causal mask; GQA groups of 1, 3 and 4; block sizes that split the
kernel's key tiles; head dims at and between powers of two.

On CUDA the kernel runs compiled, in every dtype, and `paged_attention` picks it over the SDPA
path it must agree with. On a CPU it runs under triton's interpreter (`TRITON_INTERPRET=1`),
float32 and float16 only: the interpreter multiplies bfloat16 as raw bits
(triton-lang/triton#11584). Without triton (`pip install 'shoal[gpu]'`) the module skips.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from test_attention import reference

pytest.importorskip("triton", reason="triton is not installed (pip install 'shoal[gpu]')")

from shoal.layers import attention

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET=1 is not set", allow_module_level=True)
# On a CPU, decorated for the interpreter (tests/conftest.py sets the flag before triton loads).
triton_attention = importlib.import_module("shoal.layers.triton_attention")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not GPU:
        pytest.skip("triton's interpreter multiplies bfloat16 as raw bits (triton#11584)")


def _cache(gen: torch.Generator, block: int, kv_heads: int, dim: int, dtype: torch.dtype):
    k, v = (torch.randn(48, block, kv_heads, dim, generator=gen) for _ in range(2))
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def _expected(q, k_cache, v_cache, table, ctx) -> torch.Tensor:
    keys = k_cache[table].flatten(0, 1)[:ctx].cpu()
    values = v_cache[table].flatten(0, 1)[:ctx].cpu()
    return reference(q.cpu(), keys, values)  # scale: head_dim ** -0.5


# heads, kv_heads, head_dim, block size: few KV heads, as the interpreter runs each program in
# Python (about 30 ms a program).
SHAPES = [(2, 2, 16, 4), (6, 2, 24, 16), (8, 2, 64, 16)]
SHAPE_IDS = ["mha-d16-b4", "gqa3-d24-b16", "gqa4-d64-b16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(dtype, heads, kv_heads, dim, block):
    _check_dtype(dtype)
    gen = torch.Generator().manual_seed(heads * dim + block)
    k_cache, v_cache = _cache(gen, block, kv_heads, dim, dtype)
    lens = [1, 7, block, 3 * block + 1, 130]
    width = -(-max(lens) // block)
    tables = torch.stack([torch.randperm(48, generator=gen)[:width] for _ in lens]).to(DEVICE)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(lens, device=DEVICE)
    triton_attention.paged_decode(q, k_cache, v_cache, tables, seq_lens, out, dim**-0.5)
    for i, ctx in enumerate(lens):
        want = _expected(q[i : i + 1], k_cache, v_cache, tables[i], ctx)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out[i : i + 1].cpu().double(), want, atol=tol, rtol=tol)


def _mixed_batch(gen, heads, kv_heads, dim, block, dtype):
    """Two decodes, then chunks: a whole prompt, one after cached context, one of a single
    key tile's width after a long context (rows: (query rows, context))."""
    k_cache, v_cache = _cache(gen, block, kv_heads, dim, dtype)
    rows = [(1, 40), (1, 9), (30, 30), (20, 70), (3, 150)]
    width = -(-max(c for _, c in rows) // block)
    tables = torch.stack([torch.randperm(48, generator=gen)[:width] for _ in rows]).to(DEVICE)
    q = torch.randn(sum(n for n, _ in rows), heads, dim, generator=gen).to(DEVICE, dtype)
    starts = [sum(n for n, _ in rows[:i]) for i in range(len(rows))]
    spans = [(s, n, c) for s, (n, c) in zip(starts, rows, strict=True) if n > 1]
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=DEVICE),
        num_decodes=2,
        decode_block_tables=tables[:2],
        decode_lens=torch.tensor([c for _, c in rows[:2]], device=DEVICE),
        prefills=[
            attention.PrefillChunk(s, n, c, t)
            for (s, n, c), t in zip(spans, tables[2:], strict=True)
        ],
        prefill_spans=torch.tensor(spans, device=DEVICE),
        prefill_tables=tables[2:],
    )
    return q, k_cache, v_cache, meta, list(zip(starts, rows, tables, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), SHAPES, ids=SHAPE_IDS)
def test_prefill_chunks_match_reference(dtype, heads, kv_heads, dim, block):
    """Only the chunks' rows are written: the decodes' rows before them stay as they were."""
    _check_dtype(dtype)
    gen = torch.Generator().manual_seed(7 * heads + dim + block)
    q, k_cache, v_cache, meta, rows = _mixed_batch(gen, heads, kv_heads, dim, block, dtype)
    out = torch.full_like(q, float("nan"))
    assert meta.prefill_spans is not None and meta.prefill_tables is not None
    triton_attention.paged_prefill(
        q, k_cache, v_cache, meta.prefill_spans, meta.prefill_tables, 30, out, dim**-0.5
    )
    assert out[:2].isnan().all()
    for start, (n, ctx), table in rows[2:]:
        want = _expected(q[start : start + n], k_cache, v_cache, table, ctx)
        tol = TOLERANCE[dtype]
        got = out[start : start + n].cpu().double()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(not GPU, reason="paged_attention picks the Triton kernel on CUDA only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_on_cuda_agrees_with_sdpa(dtype, monkeypatch):
    """The engine's entry point takes the kernel on CUDA and agrees with its SDPA path."""
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, meta, rows = _mixed_batch(gen, 9, 3, 64, 16, dtype)
    assert attention.triton_kernels(q, k_cache) is not None
    # The new tokens' keys and values, as `rope_and_store` left them in the cache.
    k, v = (
        torch.cat([c[t].flatten(0, 1)[ctx - n : ctx] for _, (n, ctx), t in rows])
        for c in (k_cache, v_cache)
    )
    fast = attention.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
    monkeypatch.setattr(attention, "_triton_module", lambda: None)
    slow = attention.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fast.float(), slow.float(), atol=tol, rtol=tol)
