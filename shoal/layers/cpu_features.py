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
def _cpuinfo_field(names: tuple[str, ...]) -> str:
    """The first /proc/cpuinfo line named one of `names` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo_field(_FLAG_LINES).split())


def cpu_vendor() -> str:
    """ "GenuineIntel", "AuthenticAMD", ... (empty on Arm, whose cpuinfo names no vendor)."""
    return _cpuinfo_field(("vendor_id",))


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


def bf16_tiles_pay() -> bool:
    """Whether attention tiles of bfloat16 dot products (VDPBF16PS) outrun float32 FMAs here.

    On AMD's Zen 4 a VDPBF16PS does twice an FMA's multiply-adds at the same rate: bfloat16
    prefill tiles ran 170-199 GFLOP/s against 119-129 for float32. An Intel Emerald Rapids core
    issued about two 512-bit FMAs a cycle but a VDPBF16PS only every 2.3 cycles (measured 155
    against 74 GFLOP/s a core), so there bfloat16 tiles are the slower ones: W1's prefill
    attention took 2.6-2.8 s in bfloat16 tiles and 1.7-2.0 s with the queries widened to
    float32 against the same bfloat16 cache."""
    return "avx512_bf16" in cpu_flags() and cpu_vendor() != "GenuineIntel"
