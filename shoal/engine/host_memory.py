"""Keep freed host memory in the process instead of handing it back to the kernel each step.

A forward pass allocates and frees tens of megabytes of temporaries. With glibc's defaults,
big blocks are `mmap`ped and unmapped on free, and the heap top is trimmed, so the next step
page-faults the same memory back in: on the reference 2-core machine that made the first
prefill steps of a fresh process about 30% slower (silu, rotary and copies twice as slow).
Raising the mmap and trim thresholds keeps the memory for reuse. It is process-wide, like
torch's thread count; `SHOAL_MALLOC_TUNING=0` leaves the allocator alone.

The other side of keeping memory: what a closed engine freed (its host-memory tier, gigabytes)
stays with the arena of the thread that freed it, and a new engine's threads allocate from
theirs, so a restart in the same process would hold both. A new engine returns it first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold (half a thread arena's 64 MiB heap): a step's largest
# temporaries (25 MB of MLP activations at 2048 tokens on SmolLM2) stay below it.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _allocator() -> ctypes.CDLL | None:
    """glibc, unless the user leaves the allocator alone."""
    return None if os.environ.get("SHOAL_MALLOC_TUNING", "1") == "0" else _glibc()


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc once; True when it was tuned."""
    libc = _allocator()
    if libc is None:
        return False
    try:
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
        )
    except AttributeError:
        ok = False
    if not ok:
        log.debug("malloc tuning unavailable; freed memory goes back to the kernel")
    return ok


def return_freed_memory() -> None:
    """Give the kernel every free page the arenas hold (glibc's `malloc_trim`)."""
    libc = _allocator()
    if libc is not None:
        libc.malloc_trim(0)
