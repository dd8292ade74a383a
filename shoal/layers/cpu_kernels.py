"""The C++ CPU kernels: compiled with the system's C++ compiler on first use, called by ctypes.

No torch headers are involved, so a build takes about a second; the library is cached under
`$SHOAL_CACHE_DIR` (default `~/.cache/shoal`) keyed by source, compiler and CPU. Without a
compiler (or with `SHOAL_DISABLE_CPU_KERNELS=1`) callers fall back to the pure-torch path.
Fast math lets the softmax use vector `exp` (about 1.5x on the kernel); its inputs are finite
attention scores, so nothing relies on IEEE special cases.
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
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# Compile with fast math (vector `exp` in the softmax) but link without it: linking with
# -ffast-math would pull in crtfastmath.o, which flushes subnormals for the whole process.
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC", "-c"]
_LINK = ["-shared", "-pthread"]
_FUNCS = {torch.float32: "paged_decode_f32", torch.float64: "paged_decode_f64"}


def _cpu_id() -> str:
    try:
        return next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()


@functools.cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("SHOAL_DISABLE_CPU_KERNELS"):
        return None
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        log.warning("no C++ compiler found: using the slower pure-torch decode attention")
        return None
    source = _SOURCE.read_bytes()
    flags = " ".join([cxx, *_COMPILE, *_LINK, _cpu_id()])
    key = hashlib.sha256(source + flags.encode()).hexdigest()[:16]
    cache = cache_root() / "kernels"
    lib_path = cache / f"paged_decode-{key}.so"
    if not lib_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            obj, built = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
            try:
                for cmd in (
                    [cxx, *_COMPILE, str(_SOURCE), "-o", str(obj)],
                    [cxx, *_LINK, str(obj), "-o", str(built)],
                ):
                    subprocess.run(cmd, check=True, capture_output=True)
                os.replace(built, lib_path)  # atomic: concurrent builders never see a partial file
            except (OSError, subprocess.CalledProcessError) as e:
                log.warning("building the CPU kernels failed (%s): using pure torch", e)
                return None
    lib = ctypes.CDLL(str(lib_path))
    for name in _FUNCS.values():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int64] * 6
            + [
                ctypes.c_double,
                ctypes.c_int64,
            ]
        )
    return lib


def paged_decode_available(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FUNCS and load() is not None


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
    getattr(lib, _FUNCS[q.dtype])(
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
