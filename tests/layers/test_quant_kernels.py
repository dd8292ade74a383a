"""The quantized products agree with a float64 reference of their dequantized operands on every
build this CPU runs: the native one, AVX2 (VPMADDUBSW), the VNNI builds (VPDPBUSD, AVX-VNNI
and AVX-512 VNNI), the AMX build (tiles for 16 rows and more; each skipped with the reason on
CPUs without it) and the portable one. The VNNI and AMX builds are compiled on every x86
machine, so their code at least builds and dispatches."""

from __future__ import annotations

import pytest
import torch

from shoal.layers import cpu_kernels, kernel_library, quant_kernels
from shoal.layers.cpu_features import cpu_flags, has_avx512, is_x86
from shoal.layers.cpu_kernels import CpuKernels
from shoal.layers.quant_formats import FORMATS, quantize

AVX2 = {"avx2", "fma", "f16c"}
# target -> (the dot product it holds, the CPU flags it needs to run, why it may not)
TARGETS = {
    "x86-64-v3": ("avx2", AVX2, "no AVX2 + FMA"),
    "x86-64-v3+avxvnni": ("avxvnni", AVX2 | {"avx_vnni"}, "no AVX-VNNI"),
    "x86-64-v4+avx512vnni": ("avx512vnni", {"avx512_vnni"}, "no AVX-512 VNNI"),
    "sapphirerapids": ("avx512vnni", {"avx512_vnni", "amx_int8", "amx_bf16"}, "no AMX-INT8"),
    "x86-64": ("generic", set(), ""),
}


def _runs(target: str) -> bool:
    needs = TARGETS[target][1]
    return needs <= cpu_flags() and (not target.startswith("x86-64-v4") or has_avx512())


def _builds() -> list:
    if not is_x86():
        return [pytest.param("native", id="native")]
    params = [pytest.param("native", id="native")]
    for target, (isa, _, why) in TARGETS.items():
        skip = pytest.mark.skipif(not _runs(target), reason=f"this CPU has {why}")
        name = "amx" if target == "sapphirerapids" else isa
        params.append(pytest.param(target, id=name, marks=skip))
    return params


@pytest.fixture(params=_builds())
def kernels(request: pytest.FixtureRequest) -> CpuKernels:
    built = cpu_kernels.build(request.param)
    if built is None:
        if kernel_library.compiler() is not None:
            pytest.fail(f"the {request.param} kernels did not build (see the logged warning)")
        pytest.skip("no C++ compiler")
    return built


def _expected_native_isa() -> str:
    flags = cpu_flags()
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "avx512vnni"
    if "avx_vnni" in flags and flags >= AVX2:
        return "avxvnni"
    return "avx2" if flags >= AVX2 else "generic"


def test_each_build_multiplies_with_its_dot_product(kernels: CpuKernels) -> None:
    isa = quant_kernels.isa(kernels)
    if kernels.march == "native":
        assert isa == (_expected_native_isa() if is_x86() else "generic")
    else:
        assert isa == TARGETS[kernels.march][0]
    # AMX tiles for 16 rows and more where the build has them and Linux lends them (it does on
    # every AMX machine this suite has run on).
    amx = kernels.march in ("native", "sapphirerapids") and "amx_int8" in cpu_flags()
    assert kernels.amx_int8 == amx
    # Prefill's two-level products stay integer where the 512-bit tiles (or AMX) make them
    # faster than the float32 kernel over dequantized panels.
    assert kernels.integer_prefill == (isa == "avx512vnni")


@pytest.mark.skipif(not is_x86(), reason="x86 targets")
@pytest.mark.parametrize("target", ["x86-64-v3+avxvnni", "x86-64-v4+avx512vnni", "sapphirerapids"])
def test_vnni_builds_compile_and_pick_vnni_everywhere(target: str) -> None:
    """Where the CPU cannot run them, the builds still compile and select VPDPBUSD (the AMX
    build for fewer than 16 rows)."""
    if kernel_library.compiler() is None:
        pytest.skip("no C++ compiler")
    path = kernel_library.compiled(target)
    assert path is not None
    assert TARGETS[target][0].encode() + b"\0" in path.read_bytes()


@pytest.mark.parametrize("levels", [1, 2])
def test_rows_quantize_to_the_nearest_level(kernels: CpuKernels, levels: int) -> None:
    """One int8 level: the nearest of 255 per block; two: the residual too, within half of
    1/254 of the first level's step."""
    x = torch.randn(5, 96) * torch.tensor([1.0, 1e-3, 30.0, 0.0, 1.0])[:, None]
    x[4, 32:64] = 0.0  # a block of zeros
    x[0, 5] = 40.0  # an outlier feature
    q, blocks = quant_kernels.quantize_rows(kernels, x, levels)
    assert q.shape == (5, 96 * levels) and q.abs().max() <= 127
    step = x.view(5, 3, 32).abs().amax(-1) / 127 / (254 if levels == 2 else 1)
    torch.testing.assert_close(blocks[..., 0], step, rtol=1e-6, atol=0)
    values = quant_kernels.dequantize_rows(q, blocks).view(5, 3, 32)
    err = (values - x.view(5, 3, 32).double()).abs()
    assert (err <= step.unsqueeze(-1).double() * (0.5 + 1e-3)).all()
    assert (values[4, 1] == 0).all()
    torch.testing.assert_close(blocks[..., 1].double(), values.sum(-1), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 8, 32), (3, 21, 64), (6, 40, 96), (16, 8, 32), (70, 19, 160), (275, 37, 64)],
)
def test_products_match_float64_of_the_dequantized_operands(
    kernels: CpuKernels, name: str, m: int, n: int, k: int, levels: int
) -> None:
    """Rows 1-6 cover every tile height, 70 a second block of rows; n not a multiple of 8
    leaves a partial group. With AMX, 16 rows are one tile, 70 four and six rows left over,
    275 a second block of 256 rows, and 37 columns two panels and a partial third."""
    torch.manual_seed(m * n + k)
    weight = quantize(torch.randn(n, k), FORMATS[name])
    x = torch.randn(m, k)
    x[0, 3] = 50.0  # an outlier feature, as real models have
    bias = torch.randn(n)
    q, blocks = quant_kernels.quantize_rows(kernels, x, levels)
    out = quant_kernels.qgemm(kernels, q, blocks, weight, bias)
    a, w = quant_kernels.dequantize_rows(q, blocks), weight.dequantize(torch.float64)
    expected = a @ w.T + bias.double()
    # Exact integer sums per block; float32 only in the scales and the sum over blocks.
    scale = (a.abs() @ w.abs().T).max()
    assert (out.double() - expected).abs().max() <= 1e-6 * scale
    # Against the float rows: the rounding of the activations, 1% of the largest product with
    # one level (more in the outlier's row), 1e-4 with two.
    bound = 2e-2 if levels == 1 else 1e-4
    assert (out.double() - (x.double() @ w.T + bias.double())).abs().max() <= bound * scale


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantizing_gemm_matches_float64_of_the_dequantized_weight(
    kernels: CpuKernels, name: str
) -> None:
    """Prefill's path: float32 rows against the weight dequantized a panel (two groups) at a
    time; 37 columns leave a partial panel and a missing group."""
    if not kernels.has_gemm(torch.float32):
        pytest.skip("the float32 kernel is in AVX2 builds")
    torch.manual_seed(1)
    weight = quantize(torch.randn(37, 96), FORMATS[name])
    x, bias = torch.randn(40, 96), torch.randn(37)
    out = quant_kernels.dequantizing_gemm(kernels, x, weight, bias)
    w = weight.dequantize(torch.float64)
    expected = x.double() @ w.T + bias.double()
    assert (out.double() - expected).abs().max() <= 1e-5 * (x.double().abs() @ w.abs().T).max()
