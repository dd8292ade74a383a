"""Every build of the C++ kernels this CPU can run agrees with a float64 reference.

The engine runs the `-march=native` build; the AVX2 + FMA build (`x86-64-v3`) and the portable
one (`x86-64`, no vector code of ours) are built and run here too where the CPU executes them,
so an AVX-512 machine also checks the AVX2 path. Builds this CPU cannot run are skipped, with
the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.layers import weight_packing
from shoal.layers.attention import AttentionMetadata, _gathered_decode
from shoal.layers.cpu_kernels import CpuKernels
from shoal.layers.rotary import rotate


def _decode_case(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int, dim: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks, kv_heads, heads, batch = 64, 3, 9, 7
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float64).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float64).to(kv_dtype)
    lens = torch.randint(1, 8 * block_size, (batch,), generator=gen)
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    q = torch.randn(batch, heads, dim, generator=gen, dtype=torch.float64).to(q_dtype)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),  # VDPBF16PS where the build has AVX512_BF16
    ],
)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dim", [16, 64, 128])  # 64 and 128 take the vector code
def test_decode_matches_float64(
    kernels: CpuKernels, q_dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int, dim: int
) -> None:
    q, k_cache, v_cache, tables, lens = _decode_case(q_dtype, kv_dtype, block_size, dim)
    out = torch.empty_like(q)
    kernels.paged_decode(q, k_cache, v_cache, tables, lens, out, 0.25)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(q), tables, lens, [])
    expected = _gathered_decode(q.double(), k_cache.double(), v_cache.double(), meta, 0.25)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[q_dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 8, 16), (7, 40, 37), (13, 64, 100), (100, 33, 48), (5, 24, 512)]
)
def test_gemm_matches_float64(
    kernels: CpuKernels, weight_dtype: torch.dtype, m: int, k: int, n: int
) -> None:
    """Every tile height (1-6 rows), partial panels, a bias, a row stride that is not k and
    an output row padded off a multiple of 1 KiB (512 columns)."""
    if not kernels.has_gemm(weight_dtype):
        pytest.skip(f"the {kernels.isa} build has no matrix-product kernel (needs AVX2 + FMA)")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k + 3, generator=gen)[:, 2 : k + 2]  # strided rows
    packed = weight_packing.pack_weight(w)
    assert packed.dtype == weight_dtype and packed.shape == (-(-n // 16), k, 16)
    expected = F.linear(x.double(), w.double(), bias.double())
    got = kernels.gemm(x, packed, n, bias).double()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        kernels.gemm(x, packed, n, None).double(), expected - bias.double(), atol=1e-4, rtol=1e-4
    )


_GEMM512_SHAPES = [(1, 8, 16), (7, 40, 37), (13, 64, 100), (100, 34, 130), (5, 24, 512)]


def _gemm512_case(
    kernels: CpuKernels, dtype: torch.dtype, m: int, k: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not kernels.has_gemm512(dtype):
        need = "AVX512_BF16" if dtype == torch.bfloat16 else "AVX-512"
        pytest.skip(f"the {kernels.march} build has no {need} kernel (this CPU or target)")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(m, k + 4, generator=gen).to(dtype)[:, 2 : k + 2]  # strided rows
    return x, w, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), _GEMM512_SHAPES)
def test_gemm512_matches_float64(
    kernels: CpuKernels, dtype: torch.dtype, m: int, k: int, n: int
) -> None:
    """Every tile height and width, partial panels, a bias, strided rows and an output row
    padded off a multiple of 1 KiB (512 columns); bfloat16 sums are rounded once."""
    x, w, bias = _gemm512_case(kernels, dtype, m, k, n)
    packed = weight_packing.pack_for_gemm512(w)
    assert packed.shape[0] == -(-n // 16) and packed[0].numel() == k * 16
    got = kernels.gemm512(x, packed, n, weight_packing.pack_bias(bias))
    expected = F.linear(x.double(), w.double(), bias.double())
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), _GEMM512_SHAPES)
def test_gemm512_silu_epilogue_equals_the_separate_pass(
    kernels: CpuKernels, dtype: torch.dtype, m: int, k: int, n: int
) -> None:
    """silu(gate) * up in the product's epilogue is the product followed by `silu_mul` (the same
    roundings; the vector exp may differ in its last bit, which can move a bfloat16 result by
    one unit), gate and up panels interleaved, half-panels padded."""
    x, w, bias = _gemm512_case(kernels, dtype, m, k, 2 * n)
    packed = weight_packing.pack_for_gemm512(w)
    unfused = kernels.gemm512(x, packed, 2 * n, weight_packing.pack_bias(bias))
    packed, packed_bias = weight_packing.pack_gate_up(w, bias)
    got = kernels.gemm512(x, packed, n, packed_bias, silu=True)
    assert got.shape == (m, n)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]  # one unit in the last place
    torch.testing.assert_close(got, kernels.silu_mul(unfused), atol=1e-6, rtol=tol)


_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _act(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(
    kernels: CpuKernels, dtype: torch.dtype, with_residual: bool
) -> None:
    x = _act((37, 80), dtype, 1)[:, :72]  # strided rows
    weight = _act((72,), dtype, 2)
    residual = _act((37, 72), dtype, 3)
    total = x.double() + residual.double() if with_residual else x.double()
    expected = F.rms_norm(total, (72,), weight.double(), 1e-6)
    got = kernels.rms_norm(x, weight, 1e-6, residual if with_residual else None)
    tol = _TOL[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    if with_residual:  # the sum became the new residual
        torch.testing.assert_close(residual.double(), total, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_silu_mul_matches_float64(kernels: CpuKernels, dtype: torch.dtype) -> None:
    gate_up = _act((19, 2 * 40 + 16), dtype, 4)[:, :80]  # strided rows
    gate, up = gate_up.double().split(40, dim=1)
    expected = F.silu(gate) * up
    tol = _TOL[dtype]
    torch.testing.assert_close(kernels.silu_mul(gate_up).double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 63, 1000])
def test_argmax_is_torchs_including_ties(
    kernels: CpuKernels, dtype: torch.dtype, width: int
) -> None:
    logits = _act((9, width + 7), dtype, 5)[:, :width]  # strided rows
    logits[1, -1] = 100.0  # the max in the tail after the vector steps
    logits[2] = -3.0  # all tied: the first index
    logits[3, width // 2 :] = 100.0  # tied from the middle on
    logits[4, 0] = 100.0
    got = kernels.argmax(logits)
    assert got is not None and torch.equal(got, logits.argmax(dim=-1))
    assert kernels.argmax(logits.double()) is None  # float64 is left to torch


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float64),
        (torch.float32, torch.bfloat16),
    ],
)
def test_rope_store_rotates_and_writes_the_slots(
    kernels: CpuKernels, dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    tokens, heads, kv_heads, dim, max_pos = 11, 6, 2, 64, 50
    qkv = _act((tokens, (heads + 2 * kv_heads) * dim + 8), dtype, 5)[:, :-8]  # strided rows
    original = qkv.double().clone()
    angles = torch.rand(max_pos, dim // 2, generator=torch.Generator().manual_seed(6)) * 6
    table = torch.float64 if dtype == torch.float64 else torch.float32
    cos = torch.cat([angles.cos()] * 2, dim=1).to(table)
    sin = torch.cat([angles.sin()] * 2, dim=1).to(table)
    positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(7))
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(8))[:tokens]
    k_cache = torch.zeros(10, 4, kv_heads, dim, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    kernels.rope_store(qkv, heads, kv_heads, cos, sin, positions, slots, k_cache, v_cache)

    split = original.view(tokens, heads + 2 * kv_heads, dim)
    rows = (cos[positions].double()[:, None], sin[positions].double()[:, None])
    rotated = rotate(split[:, : heads + kv_heads], rows)
    tol = _TOL[dtype] if kv_dtype == dtype else _TOL[torch.bfloat16]
    got = qkv.double().view(tokens, heads + 2 * kv_heads, dim)
    torch.testing.assert_close(got[:, : heads + kv_heads], rotated, atol=tol, rtol=tol)
    torch.testing.assert_close(got[:, heads + kv_heads :], split[:, heads + kv_heads :])
    flat_k = k_cache.view(-1, kv_heads, dim).double()
    flat_v = v_cache.view(-1, kv_heads, dim).double()
    torch.testing.assert_close(flat_k[slots], rotated[:, heads:], atol=tol, rtol=tol)
    torch.testing.assert_close(flat_v[slots], split[:, heads + kv_heads :], atol=tol, rtol=tol)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_gather_and_scatter_anywhere_in_the_pool(
    kernels: CpuKernels, dtype: torch.dtype
) -> None:
    caches = [_act((32, 4, 2, 8), dtype, seed) for seed in range(6)]
    ids = torch.tensor([17, 3, 30, 4, 5, 11])
    gathered = kernels.gather_blocks(caches, ids)
    for b, block in enumerate(gathered):  # one buffer per block: every cache's bytes in turn
        expected = torch.cat([c[ids[b]].reshape(-1).view(torch.uint8) for c in caches])
        assert torch.equal(block, expected)
    fresh = [torch.zeros_like(c) for c in caches]
    kernels.scatter_blocks([t.data_ptr() for t in gathered], fresh, ids)
    for before, after in zip(caches, fresh, strict=True):
        assert torch.equal(after[ids], before[ids])
        assert after.count_nonzero() == before[ids].count_nonzero()


def _prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each chunk over its gathered context, in float64."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for (start, length, ctx), table in zip(spans.tolist(), tables, strict=True):
        keys = k_cache.double()[table].flatten(0, 1)[:ctx].repeat_interleave(heads // kv_heads, 1)
        values = v_cache.double()[table].flatten(0, 1)[:ctx]
        values = values.repeat_interleave(heads // kv_heads, 1)
        rows = q[start : start + length].double()
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
        future = torch.arange(ctx)[None, :] > torch.arange(ctx - length, ctx)[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out[start : start + length] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 16)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_matches_float64(
    kernels: CpuKernels,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
) -> None:
    """Chunks with and without cached context, of 1 to 70 tokens (partial tiles, several
    tiles, partial key blocks), rows strided as in the fused qkv projection."""
    gen = torch.Generator().manual_seed(3)
    num_blocks = 96
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float64).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float64).to(kv_dtype)
    chunks = [(70, 70), (1, 40), (33, 33), (17, 90), (2, 2)]  # (query tokens, context)
    spans, start = [], 0
    for length, ctx in chunks:
        spans.append((start, length, ctx))
        start += length
    width = -(-max(ctx for _, ctx in chunks) // block_size)
    blocks = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([blocks[i * 16 : i * 16 + width] for i in range(len(chunks))])
    rows = torch.randn(start, heads + 8, dim, generator=gen, dtype=torch.float64)
    q = rows.to(q_dtype)[:, :heads]  # strided token rows
    out = torch.empty(start, heads, dim, dtype=q_dtype)
    spans_t = torch.tensor(spans)
    kernels.paged_prefill(q, k_cache, v_cache, spans_t, tables, out, 0.125)
    expected = _prefill_reference(q, k_cache, v_cache, spans_t, tables, 0.125)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[q_dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
