"""One decode step on a GPU, three ways: its wall time (what a user waits for), the GPU's own busy
time inside it (kernel and copy records of torch.profiler), and the HBM roofline of the bytes
the step must move (every weight once, each sequence's KV). Wall time far above busy time is
launch overhead: the GPU idles while Python issues kernels, the gap CUDA graphs close.

Used by `gpu_w1.py`; needs a CUDA device.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from shoal import LLM, SamplingParams


def hbm_bandwidth(device: str = "cuda", gib: int = 2) -> float:
    """Bytes a second a device-to-device copy moves, counting what it reads and writes (best
    of five): the practical ceiling for a memory-bound step."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / best


def step_bytes(llm: LLM, context_lens: list[int]) -> dict[str, float]:
    """What one decode step over sequences of these lengths reads and writes in HBM: each
    weight once (a tied embedding once, as the LM head), each sequence's cached keys and
    values, and one new key and value per sequence in every layer."""
    runner = llm.engine.runner
    storages: dict[int, int] = {}
    for p in runner.model.parameters():
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    k_cache = runner.kv_caches()[0][0]
    per_token = 2 * len(runner.kv_caches()) * k_cache[0, 0].numel() * k_cache.element_size()
    weights = float(sum(storages.values()))
    kv_read = float(per_token * sum(context_lens))
    kv_written = float(per_token * len(context_lens))
    return {
        "weights": weights,
        "kv_read": kv_read,
        "kv_written": kv_written,
        "total": weights + kv_read + kv_written,
    }


def _gpu_seconds(prof: Any) -> float:
    """Time the GPU spent in kernels, copies and sets (one stream: they do not overlap)."""
    total_us = 0.0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            total_us += event.time_range.elapsed_us()
    return total_us / 1e6


def _graph_replay_seconds(llm: LLM, batch: int, replays: int = 20) -> float | None:
    """GPU time of the captured graph for `batch` rows, replayed back to back (one launch each,
    so the GPU never waits for the host): independent of the profiler's records."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    size = graphs.rows.bucket(batch)
    if size is None:
        return None
    graph = graphs._graphs[size]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def profile_decode(llm: LLM, prompts: list[list[int]], steps: int = 20) -> dict[str, Any]:
    """Admit every prompt, run until all of them are decoding, then time `steps` decode steps
    plain and `steps` more under the profiler (CUDA records only, so the host's pace is not
    slowed). The KV the pass writes is overwritten by later requests' prefills."""
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * steps + 64, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"profile-{i}")
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    context_lens = [s.num_tokens for s in scheduler.running]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    busy = _gpu_seconds(prof) / steps
    replay = _graph_replay_seconds(llm, len(prompts))
    engine.reset()
    return {
        "batch": len(prompts),
        "steps": steps,
        "step_wall_ms": wall * 1e3,
        "step_gpu_ms": busy * 1e3,
        "gpu_busy_share": busy / wall if wall else None,
        "launch_overhead_share": 1 - busy / wall if wall else None,
        "graph_replay_ms": None if replay is None else replay * 1e3,
        "mean_context": sum(context_lens) / len(context_lens),
        "context_lens": context_lens,
    }


def roofline(bytes_moved: dict[str, float], bandwidth: float, profile: dict[str, Any]) -> dict:
    """The step's bytes against the measured bandwidth: the least time the step can take, and
    how close the GPU's busy time and the wall time come to it."""
    floor_ms = bytes_moved["total"] / bandwidth * 1e3
    return {
        "bytes": bytes_moved,
        "hbm_bytes_per_s": bandwidth,
        "floor_ms": floor_ms,
        "of_gpu_time": floor_ms / profile["step_gpu_ms"] if profile["step_gpu_ms"] else None,
        "of_wall_time": floor_ms / profile["step_wall_ms"],
    }
