"""Freed temporaries stay in the process: reusing them costs no page faults."""

from __future__ import annotations

import platform
import resource
import threading

import pytest
import torch

from shoal.engine import host_memory


def faults_of_a_step() -> int:
    """Page faults of one step-like burst: a few activation-sized temporaries live at once."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    live = [torch.empty(mb << 20, dtype=torch.uint8).fill_(1) for mb in (12, 25, 6, 3, 12)]
    del live
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_later_steps_reuse_the_first_steps_memory() -> None:
    assert host_memory.keep_freed_memory()
    faults_of_a_step()
    pages = (58 << 20) // 4096
    # Untuned, every step faults nearly all its pages back in: five steps ~ 5 x pages.
    assert sum(faults_of_a_step() for _ in range(5)) < pages


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_memory_freed_on_another_thread_goes_back_when_returned() -> None:
    """A closed engine's host tier, freed on a thread's arena, goes back to the kernel when
    the next engine starts, instead of staying next to the new one's."""
    assert host_memory.keep_freed_memory()

    def host_tier_come_and_gone() -> None:
        blocks = [torch.ones(737_280, dtype=torch.uint8) for _ in range(400)]  # ~280 MiB
        del blocks

    worker = threading.Thread(target=host_tier_come_and_gone)
    worker.start()
    worker.join()
    held = rss_bytes()
    host_memory.return_freed_memory()
    assert held - rss_bytes() > 200 << 20


def test_opt_out_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MALLOC_TUNING", "0")
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        monkeypatch.delenv("SHOAL_MALLOC_TUNING")
        host_memory.keep_freed_memory.cache_clear()
        host_memory.keep_freed_memory()
