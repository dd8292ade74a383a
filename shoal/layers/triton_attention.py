"""Paged attention on CUDA as one Triton kernel that reads the KV blocks in place.

The cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]`. One program takes one
sequence, one tile of its query tokens and one KV head, and walks that sequence's block table
tile by tile with an online softmax (flash attention's recurrence), so no block is gathered
into a padded copy and one launch covers every sequence of the step. The rows of a program's
query tile are `BLOCK_Q` tokens × the `GROUP` query heads that share the KV head (GQA), so a
KV tile is read once for the whole group and both products are tensor-core `tl.dot`s.

The same kernel serves single-token decodes (row i of the batch is sequence i; its length is
`seq_lens[i]`) and prefill chunks, which attend causally over their cached tokens and
themselves (`spans` rows `(q_start, q_len, context_len)`, as `AttentionMetadata` carries them).
Accumulation is float32; float32 products run as IEEE float32, not TF32, so greedy float32
output can match a float32 reference. Under `TRITON_INTERPRET=1` it runs on CPU tensors (the
tests), slowly. This module imports triton: import it only where triton is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Query rows of one program: tensor-core products need at least 16 of them.
DECODE_ROWS = 16
PREFILL_ROWS = 64


# The table's row stride is the step's longest table in eager steps: not specialized on, so a
# new length never compiles the kernel again mid-run.
@triton.jit(do_not_specialize=["stride_table"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    spans_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DECODE: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    if DECODE:
        q_start = seq
        q_len = 1
        ctx = tl.load(seq_lens_ptr + seq)
    else:
        q_start = tl.load(spans_ptr + seq * 3)
        q_len = tl.load(spans_ptr + seq * 3 + 1)
        ctx = tl.load(spans_ptr + seq * 3 + 2)
    if q_tile * BLOCK_Q < q_len:
        # Row r of the tile: query token q_tile * BLOCK_Q + r // G_PAD, head r % G_PAD of the
        # group (padded to a power of two; the padding rows are masked out).
        rows = tl.arange(0, BLOCK_Q * G_PAD)
        token = q_tile * BLOCK_Q + rows // G_PAD
        head = kv_head * GROUP + rows % G_PAD
        row_ok = (token < q_len) & (rows % G_PAD < GROUP)
        position = ctx - q_len + token  # each query token's absolute position
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_off = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
        # The last token of the tile sees the most keys; no key past it is read.
        visible_end = tl.minimum(ctx, ctx - q_len + (q_tile + 1) * BLOCK_Q)
        table_row = tables_ptr + seq * stride_table
        for start in range(0, visible_end, TILE_N):
            key_pos = start + tl.arange(0, TILE_N)
            key_ok = key_pos < visible_end
            block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
            slot = block * stride_kb + (key_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            seen = key_ok[None, :] & (key_pos[None, :] <= position[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet (or never will: padding) keeps a zero reference.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_ref[:, None])
            alpha = tl.exp(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(
            out_ptr + o_off,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    tables: torch.Tensor,
    grid_seqs: int,
    max_q_len: int,
    scale: float,
    seq_lens: torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
) -> None:
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert out.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and tables.stride(-1) == 1
    group = heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    rows = DECODE_ROWS if seq_lens is not None else PREFILL_ROWS
    block_q = max(1, rows // g_pad)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    dummy = tables  # the pointer the kernel's unused argument gets
    grid = (grid_seqs, triton.cdiv(max_q_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        tables,
        dummy if seq_lens is None else seq_lens,
        dummy if spans is None else spans,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        TILE_N=64 if d_pad <= 128 else 32,
        DECODE=seq_lens is not None,
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Row i of q `[B, H, D]` is the last token of sequence i, which holds `seq_lens[i]`
    tokens in the blocks `block_tables[i]`; its attention goes to `out[i]`. Reads only
    tensors, so a CUDA graph can capture it and replay it with new lengths and tables."""
    _launch(q, k_cache, v_cache, out, block_tables, q.shape[0], 1, scale, seq_lens=seq_lens)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: torch.Tensor,
    tables: torch.Tensor,
    max_q_len: int,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Chunk j (`spans[j] = (q_start, q_len, context_len)`) is rows `[q_start, q_start +
    q_len)` of q, the last q_len of its context_len positions, whose keys and values (its own
    included) are already in the blocks `tables[j]`; causal attention goes to the same rows
    of `out`. `max_q_len` (the longest chunk) sizes the grid."""
    _launch(q, k_cache, v_cache, out, tables, spans.shape[0], max_q_len, scale, spans=spans)
