"""Which build of the C++ kernels runs, what each build holds, and what loading one must not
change in the process (floating-point modes, OpenMP runtimes)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.layers import cpu_kernels
from shoal.layers.cpu_features import cpu_flags, has_amx, has_avx512, is_x86
from shoal.layers.cpu_kernels import CpuKernels


def test_each_build_says_which_vector_code_it_holds(kernels: CpuKernels) -> None:
    expected = {"x86-64-v3": "avx2", "x86-64": "generic"}.get(kernels.march)
    if kernels.march == "native" and is_x86():
        flags = cpu_flags()
        expected = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    if expected is not None:
        assert kernels.isa == expected
    assert kernels.has_gemm(torch.float32) is (kernels.isa in ("avx2", "avx512"))


def test_bf16_prefill_takes_amx_tiles_where_the_cpu_has_amx(kernels: CpuKernels) -> None:
    """Only the native build compiles AMX code; on an AMX CPU it must run there (the Linux
    kernel lends the tiles on request), so `test_prefill_matches_float64` checks the AMX
    products with its blocks of 16 tokens and the VDPBF16PS ones with its blocks of 5."""
    if kernels.march != "native":
        assert not kernels.amx_tiles
        return
    if not has_amx():
        pytest.skip("this CPU has no AMX: bfloat16 prefill takes VDPBF16PS or float32 tiles")
    assert kernels.amx_tiles


def test_the_native_build_uses_avx512_where_the_cpu_has_it() -> None:
    native = cpu_kernels.native()
    if native is None:
        pytest.skip("no C++ compiler")
    if not has_avx512():
        pytest.skip("this CPU has no AVX-512: the native build is its AVX2 or portable path")
    assert native.isa == "avx512"


@pytest.mark.skipif(not is_x86() or "avx2" not in cpu_flags(), reason="the AVX2 target")
def test_the_engine_takes_another_target_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SHOAL_CPU_TARGET` builds the engine's kernels for another target this CPU runs."""
    if cpu_kernels.build() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("SHOAL_CPU_TARGET", "x86-64-v3")
    cpu_kernels.native.cache_clear()
    try:
        kernels = cpu_kernels.native()
        assert kernels is not None and (kernels.march, kernels.isa) == ("x86-64-v3", "avx2")
        assert not kernels.amx_int8 and not kernels.integer_prefill
    finally:
        monkeypatch.delenv("SHOAL_CPU_TARGET")
        cpu_kernels.native.cache_clear()
    assert cpu_kernels.native() is cpu_kernels.build("native")


def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    # A library linked with -ffast-math would set flush-to-zero for the whole process.
    if cpu_kernels.native() is None:
        pytest.skip("no C++ compiler")
    assert (np.array([5e-324]) * 1.0)[0] > 0
    assert float(torch.tensor([1e-40], dtype=torch.float32) * 1.0) > 0


def test_kernels_share_torchs_openmp_runtime() -> None:
    """The library's OpenMP calls bind to the libgomp torch loaded: one thread pool, not two
    fighting (other packages may bring their own copies; those are not ours to fix)."""
    native = cpu_kernels.native()
    if native is None:
        pytest.skip("no C++ compiler")
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
    address = ctypes.cast(native.lib.omp_get_max_threads, ctypes.c_void_p)
    assert ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
    assert Path(info.dli_fname.decode()).resolve().parent == torch_lib.resolve()
