"""The builds of the C++ kernels this CPU can run, as a fixture for the kernel tests."""

from __future__ import annotations

import pytest

from shoal.layers import cpu_kernels, kernel_library
from shoal.layers.cpu_features import cpu_flags, is_x86
from shoal.layers.cpu_kernels import CpuKernels


def _builds() -> list:
    if not is_x86():
        return [pytest.param("native", id="native")]
    avx2 = {"avx2", "fma"} <= cpu_flags()
    return [
        pytest.param("native", id="native"),
        pytest.param(
            "x86-64-v3",
            id="avx2",
            marks=pytest.mark.skipif(not avx2, reason="this CPU has no AVX2 + FMA"),
        ),
        pytest.param("x86-64", id="generic"),
    ]


@pytest.fixture(params=_builds())
def kernels(request: pytest.FixtureRequest) -> CpuKernels:
    built = cpu_kernels.build(request.param)
    if built is None:
        if kernel_library.compiler() is not None:  # a compile error must not read as a skip
            pytest.fail(f"the {request.param} kernels did not build (see the logged warning)")
        pytest.skip("no C++ compiler")
    return built
