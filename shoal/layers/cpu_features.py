"""What this CPU can do, read once from `/proc/cpuinfo`, and the paths that follow from it.

Users run shoal on AVX2-only chips (Zen 3, Haswell), AVX-512 ones with native bfloat16 dot
products (Zen 4/5: AVX512_BF16; Sapphire/Granite Rapids: AMX too) and Arm (Graviton: `bf16`).
Where the CPU multiplies bfloat16 natively, bfloat16 models run with bfloat16 activations
through oneDNN, which picks VDPBF16PS or AMX tiles itself; elsewhere bfloat16 weights meet
float32 activations in shoal's AVX2 kernel (`layers/linear.py`, `engine/model_runner.py`).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# x86 names its list "flags", Arm "Features".
_FLAG_LINES = ("flags", "Features")
_NATIVE_BF16 = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in _FLAG_LINES:
            return frozenset(value.split())
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def has_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ: what oneDNN's `avx512_core` kernels need."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


def native_bf16() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (AVX512_BF16, AMX-BF16, Arm BF16)."""
    return bool(_NATIVE_BF16 & cpu_flags())


def has_amx() -> bool:
    """AMX tiles for bfloat16 (Sapphire/Granite Rapids), which oneDNN drives itself."""
    return "amx_bf16" in cpu_flags()
