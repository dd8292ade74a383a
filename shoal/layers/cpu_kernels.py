"""The C++ CPU kernels: compiled with the system's C++ compiler on first use, called by ctypes.

No torch headers are involved, so a build takes a few seconds; the library is cached under
`$SHOAL_CACHE_DIR` (default `~/.cache/shoal`) keyed by sources, compiler and CPU. Without a
compiler (or with `SHOAL_DISABLE_CPU_KERNELS=1`) callers fall back to the pure-torch path.
Fast math lets the softmax use vector `exp` (about 1.5x on the kernel); its inputs are finite
attention scores, so nothing relies on IEEE special cases. The kernels parallelize with OpenMP
and link `libgomp.so.1`, which resolves to the copy torch has already loaded: one thread pool.
The matrix products need AVX2 and FMA; on other CPUs only the attention kernel is used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shoal.config import cache_root

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
# Compile with fast math (vector `exp` in the softmax) but link without it: linking with
# -ffast-math would pull in crtfastmath.o, which flushes subnormals for the whole process.
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC", "-c"]
_LINK = ["-shared", "-pthread", "-fopenmp"]
_DECODE_FUNCS = {  # (query dtype, KV cache dtype)
    (torch.float32, torch.float32): "paged_decode_f32",
    (torch.float64, torch.float64): "paged_decode_f64",
    (torch.float32, torch.bfloat16): "paged_decode_f32_bf16kv",
}
_GEMM_FUNCS = {torch.float32: "gemm_f32", torch.bfloat16: "gemm_bf16w"}
PANEL = 16  # output columns per packed weight panel (gemm.cpp's NR)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _sources() -> list[Path]:
    """The attention kernel everywhere; the matrix products only where AVX2 and FMA exist."""
    has_gemm = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags()
    return [_CSRC / "paged_decode.cpp", *([_CSRC / "gemm.cpp"] if has_gemm else [])]


def _build(cxx: str, sources: list[Path], lib_path: Path) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        objs = [str(Path(tmp) / f"{src.stem}.o") for src in sources]
        for src, obj in zip(sources, objs, strict=True):
            subprocess.run([cxx, *_COMPILE, str(src), "-o", obj], check=True, capture_output=True)
        built = Path(tmp) / "kernels.so"
        subprocess.run([cxx, *_LINK, *objs, "-o", str(built)], check=True, capture_output=True)
        os.replace(built, lib_path)  # atomic: concurrent builders never see a partial file


@functools.cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("SHOAL_DISABLE_CPU_KERNELS"):
        return None
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        log.warning("no C++ compiler found: using the slower pure-torch kernels")
        return None
    sources = _sources()
    flags = " ".join([cxx, *_COMPILE, *_LINK, " ".join(sorted(_cpu_flags()))])
    digest = hashlib.sha256(flags.encode())
    for src in sources:
        digest.update(src.read_bytes())
    lib_path = cache_root() / "kernels" / f"shoal-cpu-{digest.hexdigest()[:16]}.so"
    if not lib_path.exists():
        try:
            _build(cxx, sources, lib_path)
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("building the CPU kernels failed (%s): using pure torch", e)
            return None
    lib = ctypes.CDLL(str(lib_path))
    for name in _DECODE_FUNCS.values():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = (
            [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_double, ctypes.c_int64]
        )
    for name in _GEMM_FUNCS.values():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int64]
            fn.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    return lib


def gemm_available(weight_dtype: torch.dtype) -> bool:
    """Whether `gemm` runs float32 activations against a packed weight of this dtype here."""
    lib = load()
    return lib is not None and hasattr(lib, _GEMM_FUNCS.get(weight_dtype, "-"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> `[ceil(N / 16), K, 16]`: panels of 16 output columns, k-major, zero-padded."""
    n, k = weight.shape
    pad = -n % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, k)])
    return weight.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` for float32 rows `x` `[M, K]` and a weight packed by `pack_weight`."""
    lib = load()
    assert lib is not None and x.dtype == torch.float32 and x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] == k and (bias is None or bias.dtype == torch.float32)
    # Rows a multiple of 1 KiB apart map to the same few cache sets, and the kernel writes a
    # 16-column strip down all rows at once: SmolLM2's LM head (49152 columns) ran 3x slower.
    ldc = n + PANEL if n % 256 == 0 else n
    out = torch.empty(m, ldc, dtype=torch.float32)[:, :n]
    getattr(lib, _GEMM_FUNCS[packed.dtype])(
        x.data_ptr(),
        m,
        k,
        x.stride(0),
        packed.data_ptr(),
        n,
        out.data_ptr(),
        ldc,
        None if bias is None else bias.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def paged_decode_available(q: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    return q.device.type == "cpu" and (q.dtype, kv_dtype) in _DECODE_FUNCS and load() is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """out[b] = attention of q[b] ([heads, dim]) over the first context_lens[b] cached tokens."""
    lib = load()
    assert lib is not None
    for t in (q, k_cache, v_cache, block_tables, context_lens, out):
        assert t.is_contiguous()
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    getattr(lib, _DECODE_FUNCS[q.dtype, k_cache.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        block_tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
