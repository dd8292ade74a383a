"""An optional faster BLAS for MLX on Linux CPUs.

The `mlx-cpu` wheel links the reference (netlib) BLAS, so every float matmul runs a plain
triple loop: SmolLM2-135M prefills about 15x slower than with OpenBLAS. Loading an OpenBLAS
globally *before* `mlx.core` is imported makes the dynamic linker bind MLX's `cblas_sgemm` to
it instead. It is never required: without it MLX is only slower.

Which library: `$SHOAL_MLX_BLAS` (a path to `libopenblas.so.0`, or `none` to opt out), else the
system's OpenBLAS if one is installed (Debian: `apt-get install libopenblas0-pthread`), else
nothing. Distribution builds pick their kernels at run time; a build for another CPU (some
wheels are) dies of SIGILL at the first matmul, which is why no PyPI copy is looked for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SHOAL_MLX_BLAS"


def find_openblas() -> Path | None:
    """The OpenBLAS to preload, or None."""
    choice = os.environ.get(ENV, "")
    if choice.lower() == "none":
        return None
    if choice:
        return Path(choice)
    found = ctypes.util.find_library("openblas")
    return Path(found) if found else None


def preload_openblas() -> Path | None:
    """Load OpenBLAS into the global symbol scope; returns its path if it took effect."""
    path = find_openblas()
    if path is None or sys.platform != "linux":
        return None
    if "mlx.core" in sys.modules:
        log.warning("%s: mlx.core is already imported, so its BLAS can no longer change", ENV)
        return None
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        log.warning("%s: could not load %s (%s); MLX keeps its bundled BLAS", ENV, path, e)
        return None
    return path
