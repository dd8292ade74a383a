"""The C++ decode kernel agrees with the pure-torch path and leaves the process's FP state alone."""

from __future__ import annotations

import ctypes
from pathlib import Path

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


needs_gemm = pytest.mark.skipif(
    not cpu_kernels.gemm_available(torch.float32), reason="needs AVX2 + FMA"
)


@needs_gemm
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 8, 16), (7, 40, 37), (13, 64, 100), (100, 33, 48), (5, 24, 512)]
)
def test_gemm_matches_f_linear(weight_dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """Every tile height (1-6 rows), partial panels, a bias, a row stride that is not k and
    an output row padded off a multiple of 1 KiB (512 columns)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k + 3, generator=gen)[:, 2 : k + 2]  # strided rows
    packed = cpu_kernels.pack_weight(w)
    assert packed.dtype == weight_dtype and packed.shape == (-(-n // 16), k, 16)
    expected = torch.nn.functional.linear(x.double(), w.double(), bias.double()).float()
    torch.testing.assert_close(cpu_kernels.gemm(x, packed, n, bias), expected)
    torch.testing.assert_close(
        cpu_kernels.gemm(x, packed, n, None), expected - bias, atol=1e-4, rtol=1e-4
    )


def test_bf16_cache_decode_matches_widened_torch_path() -> None:
    """float32 queries against a bfloat16 KV cache read the same numbers widened."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, heads, dim, batch = 16, 4, 3, 9, 64, 5
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    lens = torch.tensor([1, 4, 5, 17, 30])
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:8] for _ in range(batch)])
    q = torch.randn(batch, heads, dim, generator=gen)
    assert cpu_kernels.paged_decode_available(q, torch.bfloat16)
    out = torch.empty_like(q)
    cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, out, 0.125)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), batch, tables, lens, [])
    expected = _gathered_decode(q, k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kernels_share_torchs_openmp_runtime() -> None:
    """The library's OpenMP calls bind to the libgomp torch loaded: one thread pool, not two
    fighting (other packages may bring their own copies; those are not ours to fix)."""
    lib = cpu_kernels.load()
    assert lib is not None
    maps = Path("/proc/self/maps")
    torch_lib = Path(torch.__file__).parent / "lib"
    if not maps.exists() or str(torch_lib / "libgomp") not in maps.read_text():
        pytest.skip("needs /proc and a torch that bundles libgomp")

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    info = DlInfo()
    address = ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p)
    assert ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
    assert Path(info.dli_fname.decode()).resolve().parent == torch_lib.resolve()
