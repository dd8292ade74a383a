"""Paged attention over a block-structured KV cache, in plain PyTorch.

The cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]`. Each step writes the
new keys and values to their slots, then every query attends to its own sequence's blocks:
decodes in one call (the C++ kernel reads blocks in place; the torch fallback gathers them
into a padded batch), prefill chunks one sequence at a time with a causal mask offset by the
tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.layers import cpu_kernels


@dataclass(slots=True)
class PrefillChunk:
    """Query rows `[q_start, q_start + q_len)` of one sequence with `context_len` keys in all."""

    q_start: int
    q_len: int
    context_len: int
    block_ids: torch.Tensor  # blocks covering the context
    mask: torch.Tensor | None  # None: nothing cached before the chunk, plain causal attention


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decodes: int  # the first rows of the batch are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_lens: torch.Tensor | None  # [num_decodes] tokens each decode attends to
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H, D]."""
    kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    b = meta.num_decodes
    if b:
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        if cpu_kernels.paged_decode_available(q):
            cpu_kernels.paged_decode(
                q[:b].contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_lens,
                out[:b],
                scale,
            )
        else:
            out[:b] = _gathered_decode(q[:b], k_cache, v_cache, meta, scale)

    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if chunk.mask is None:
            keys, values = k[rows], v[rows]
        else:
            keys = k_cache[chunk.block_ids].view(-1, kv_heads, head_dim)[: chunk.context_len]
            values = v_cache[chunk.block_ids].view(-1, kv_heads, head_dim)[: chunk.context_len]
        # 4-D inputs take torch's fused CPU kernel; 3-D ones fell back to the slow math path.
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
    return out


def _gathered_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference decode path: gather each sequence's blocks into a padded batch."""
    assert meta.decode_block_tables is not None and meta.decode_lens is not None
    b, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    tables = meta.decode_block_tables
    keys = k_cache[tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_cache[tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    mask = (key_pos[None, :] < meta.decode_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=mask.expand(b, heads, 1, -1),
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)
