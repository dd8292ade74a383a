"""The C++ decode kernel agrees with the pure-torch path and leaves the process's FP state alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.layers import cpu_kernels
from shoal.layers.attention import AttentionMetadata, _gathered_decode

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dim", [16, 64, 128])  # 64 and 128 take compile-time specialisations
def test_kernel_matches_gathered_torch_path(dtype: torch.dtype, block_size: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, heads, batch = 64, 2, 6, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    lens = torch.randint(1, 8 * block_size, (batch,), generator=gen)
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    q = torch.randn(batch, heads, dim, generator=gen, dtype=dtype)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), batch, tables, lens, [])

    out = torch.empty_like(q)
    cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, out, 0.25)

    expected = _gathered_decode(q, k_cache, v_cache, meta, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    # A library linked with -ffast-math would set flush-to-zero for the whole process.
    assert cpu_kernels.load() is not None
    assert (np.array([5e-324]) * 1.0)[0] > 0
    assert float(torch.tensor([1e-40], dtype=torch.float32) * 1.0) > 0
