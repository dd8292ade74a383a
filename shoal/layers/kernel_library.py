"""Compiling the C++ CPU kernels (`csrc/`) for a target and caching the shared library.

No torch headers are involved, so a build takes a few seconds; the library is cached under
`$SHOAL_CACHE_DIR` (default `~/.cache/shoal`) keyed by sources, compiler, target and the CPU's
flags, and replaced atomically, so concurrent builders never see a partial file.

Fast math lets the softmax use vector `exp`; its inputs are finite attention scores, so nothing
relies on IEEE special cases. The library links without it: linking with -ffast-math would pull
in crtfastmath.o, which flushes subnormals for the whole process. OpenMP comes from
`libgomp.so.1`, which resolves to the copy torch has already loaded: one thread pool.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shoal.config import cache_root
from shoal.layers.cpu_features import cpu_flags

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "paged_decode.cpp",
    "paged_prefill.cpp",
    "gemm.cpp",
    "gemm512.cpp",
    "elementwise.cpp",
    "blocks.cpp",
    "argmax.cpp",
    "quantize.cpp",
    "qgemm.cpp",
    "decode_step.cpp",
)
_COMPILE = ["-O3", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC", "-c"]
_LINK = ["-shared", "-pthread", "-fopenmp"]


def _build(cxx: str, march: str, lib_path: Path) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        objs = [str(Path(tmp) / f"{Path(src).stem}.o") for src in _SOURCES]
        for src, obj in zip(_SOURCES, objs, strict=True):
            cmd = [cxx, *_COMPILE, *target_flags(march), str(_CSRC / src), "-o", obj]
            subprocess.run(cmd, check=True, capture_output=True)
        built = Path(tmp) / "kernels.so"
        subprocess.run([cxx, *_LINK, *objs, "-o", str(built)], check=True, capture_output=True)
        os.replace(built, lib_path)


def compiler() -> str | None:
    """The C++ compiler the kernels are built with (`$CXX`, else g++ or c++), if there is one."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def target_flags(march: str) -> list[str]:
    """`-march=` and `-m` flags of a target: "x86-64-v3", or with extensions "x86-64-v3+avxvnni"
    (the tests build each integer dot-product path this way)."""
    arch, *extensions = march.split("+")
    return [f"-march={arch}", *(f"-m{e}" for e in extensions)]


def compiled(march: str) -> Path | None:
    """The library built for `target_flags(march)` (built now if not cached), or None without
    a working compiler."""
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found: using the slower pure-torch kernels")
        return None
    flags = " ".join([cxx, march, *_COMPILE, *_LINK, " ".join(sorted(cpu_flags()))])
    digest = hashlib.sha256(flags.encode())
    for src in sorted(_CSRC.iterdir()):
        digest.update(src.read_bytes())
    lib_path = cache_root() / "kernels" / f"shoal-cpu-{digest.hexdigest()[:16]}.so"
    if not lib_path.exists():
        try:
            _build(cxx, march, lib_path)
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("building the CPU kernels for %s failed (%s): using pure torch", march, e)
            return None
    return lib_path
