"""Paged attention over a block-structured KV cache.

The cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]`. Each step rotates the
new queries and keys and writes the new keys and values to their slots (`rope_and_store`), then
every query attends to its own sequence's blocks, causally, after the tokens already cached.

On the CPU both run as C++ kernels that read the blocks in place (`csrc/paged_decode.cpp` for
decodes, `csrc/paged_prefill.cpp`, flash-style, for every prefill chunk of the step in one
call; bfloat16 queries are widened to float32 tiles where bfloat16 tiles do not pay, see
`bf16_prefill_tiles`). On CUDA, where triton imports, both run as one Triton kernel over the
blocks in place (`triton_attention.py`; float16, bfloat16, float32). Elsewhere (float64 on
CUDA, no triton, no C++ compiler, or `SHOAL_DISABLE_TRITON=1`) decodes gather their blocks into
a padded batch and each prefill chunk runs through torch's SDPA.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shoal.layers import cpu_kernels
from shoal.layers.cpu_features import bf16_tiles_pay
from shoal.layers.rotary import Rope, rotate


@dataclass(slots=True)
class PrefillChunk:
    """Query rows `[q_start, q_start + q_len)` of one sequence, the last `q_len` of its
    `context_len` positions."""

    q_start: int
    q_len: int
    context_len: int
    block_ids: torch.Tensor  # blocks covering the context


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decodes: int  # the first rows of the batch are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_lens: torch.Tensor | None  # [num_decodes] tokens each decode attends to
    prefills: list[PrefillChunk]
    # The same chunks for the C++ kernel: (q_start, q_len, context_len) rows and block tables.
    prefill_spans: torch.Tensor | None = None  # [num_prefills, 3]
    prefill_tables: torch.Tensor | None = None  # [num_prefills, max_blocks]


def rope_and_store(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    rope: Rope,
    meta: AttentionMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the q and k heads of the `[T, (heads + 2 kv_heads) * head_dim]` projection and
    write k and v to their cache slots (rounded to the cache's dtype). Returns q, k, v views
    `[T, heads or kv_heads, head_dim]`."""
    t, head_dim = qkv.shape[0], k_cache.shape[-1]
    kernels = cpu_kernels.for_tensor(qkv)
    if kernels is not None and qkv.stride(1) == 1 and kernels.ropes(qkv.dtype, k_cache.dtype):
        table = rope.table
        kernels.rope_store(
            qkv,
            heads,
            kv_heads,
            table.cos,
            table.sin,
            rope.positions,
            meta.slot_mapping,
            k_cache,
            v_cache,
        )
        split = qkv.view(t, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], 1)
        return split[0], split[1], split[2]
    qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(t, heads + kv_heads, head_dim)
    q, k = rotate(qk, rope.rows(qkv.dtype)).split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(t, kv_heads, head_dim)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return q, k, v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D], already in the cache (`rope_and_store`). Returns
    [T, H, D].

    The cache may be narrower than q (bfloat16 KV under float32 activations on the CPU): cached
    keys and values are widened when read. On the CPU both decodes and prefill chunks attend
    through C++ kernels that read the blocks in place, on CUDA through the Triton kernel."""
    out = torch.empty_like(q)
    gpu = triton_kernels(q, k_cache)

    b = meta.num_decodes
    if b:
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        kernels = cpu_kernels.native() if q.device.type == "cpu" else None
        if gpu is not None:
            gpu.paged_decode(
                q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, out[:b], scale
            )
        elif kernels is not None and kernels.decodes(q.dtype, k_cache.dtype):
            kernels.paged_decode(
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

    if meta.prefills:
        kernels = cpu_kernels.native() if q.device.type == "cpu" else None
        if gpu is not None and meta.prefill_spans is not None and meta.prefill_tables is not None:
            longest = max(c.q_len for c in meta.prefills)
            gpu.paged_prefill(
                q, k_cache, v_cache, meta.prefill_spans, meta.prefill_tables, longest, out, scale
            )
        elif (
            kernels is not None
            and meta.prefill_spans is not None
            and meta.prefill_tables is not None
            and kernels.prefills(q.dtype, k_cache.dtype)
        ):
            spans, tables = meta.prefill_spans, meta.prefill_tables
            if q.dtype == torch.bfloat16 and not bf16_prefill_tiles(kernels, k_cache.shape[1]):
                # Float32 tiles against the bfloat16 cache; only the prefill rows are copied
                # back, the decodes' rows (before them) are already written.
                wide = torch.empty(out.shape, dtype=torch.float32)
                kernels.paged_prefill(q.float(), k_cache, v_cache, spans, tables, wide, scale)
                out[b:] = wide[b:]
            else:
                kernels.paged_prefill(q, k_cache, v_cache, spans, tables, out, scale)
        else:
            _prefill_in_torch(q, k, v, k_cache, v_cache, meta, out, scale)
    return out


@functools.cache
def _triton_module() -> ModuleType | None:
    """`triton_attention`, imported on first use on a GPU (it needs triton); None without it."""
    if os.environ.get("SHOAL_DISABLE_TRITON"):
        return None
    try:
        from shoal.layers import triton_attention
    except ImportError:
        return None
    return triton_attention


def triton_kernels(q: torch.Tensor, k_cache: torch.Tensor) -> ModuleType | None:
    """The Triton kernels if they take this step: CUDA tensors of one of their dtypes."""
    if q.device.type != "cuda" or q.dtype != k_cache.dtype:
        return None
    module = _triton_module()
    return module if module is not None and q.dtype in module.DTYPES else None


def bf16_prefill_tiles(kernels: cpu_kernels.CpuKernels, block_size: int) -> bool:
    """Whether bfloat16 prefill chunks take the kernel's bfloat16 tiles: on AMX (whose tiles
    read keys 16 at a time from blocks of a multiple of 16 tokens; 1.5-2x the float32 tiles'
    rate on an Emerald Rapids), or where VDPBF16PS outruns float32 FMAs (`bf16_tiles_pay`).
    Otherwise the queries are widened to float32 tiles over the bfloat16 cache."""
    return (kernels.amx_tiles and block_size % 16 == 0) or bf16_tiles_pay()


def _prefill_in_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Each chunk attends over its gathered context (its own keys straight from k, v)."""
    kv_heads, head_dim = k_cache.shape[2:]
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if chunk.context_len == chunk.q_len:  # nothing cached before the chunk
            keys, values = k[rows], v[rows]
        else:
            ctx = chunk.context_len
            keys = k_cache[chunk.block_ids].view(-1, kv_heads, head_dim)[:ctx].to(q.dtype)
            values = v_cache[chunk.block_ids].view(-1, kv_heads, head_dim)[:ctx].to(q.dtype)
        out[rows] = prefill_attention(q[rows], keys, values, scale)


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of q `[L, H, D]`, the last L of C positions, over keys and values
    `[C, KVH, D]`, through torch's SDPA. Returns `[L, H, D]`."""
    q_len, ctx = q.shape[0], keys.shape[0]
    mask = None
    if ctx > q_len:
        key_pos = torch.arange(ctx, device=q.device)
        mask = key_pos[None, :] <= torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    # 4-D inputs take torch's fused kernels; 3-D ones fall back to the slow math path.
    return _sdpa(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)


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
    keys = k_cache[tables].view(b, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    values = v_cache[tables].view(b, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    mask = (key_pos[None, :] < meta.decode_lens[:, None])[:, None, None, :]
    return _sdpa(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=mask.expand(b, heads, 1, -1),
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)


# On CUDA, torch may pick cuDNN's attention for bfloat16, which builds an execution plan for
# every new shape: with each step's own lengths that cost ~0.6 ms of CPU a call and made
# bfloat16 W1 on an H100 2.5x slower than float32. The other fused kernels take any shape.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """torch's SDPA, without cuDNN's kernel on CUDA (see `_CUDA_SDPA`)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(_CUDA_SDPA):
        return F.scaled_dot_product_attention(q, k, v, **kw)
