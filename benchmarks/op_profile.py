"""Where shoal's time goes: exclusive wall time per kind of work, by patching a few functions.

Each patched call's time, less the time of patched calls inside it, goes to its kind, so the
kinds add up to the wall time of `Engine.step`. A wrapper costs about a microsecond and there
are a few hundred calls a step, so the profile barely moves the figure it explains.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shoal.bench import Flops


class OpProfile:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []  # time spent in nested patched calls, per open call
        self.flops = Flops()  # of the batches executed
        self.steps = 0

    def wrap(self, kind: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                total = time.perf_counter() - start
                nested = self._stack.pop()
                name = kind(*args) if callable(kind) else kind
                self.seconds[name] += total - nested
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += total

        return timed

    def report(self) -> list[str]:
        flops, steps = self.flops, self.steps
        rates = {
            "projections": flops.projections,
            "lm head": flops.lm_head,
            "attention prefill": flops.attention_prefill,
            "attention decode": flops.attention_decode,
        }
        total = sum(self.seconds.values())
        lines = [f"  {'kind':<34} {'s':>7} {'share':>6} {'GFLOP/s':>8}"]
        for name, sec in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            rate = f"{rates[name] / sec / 1e9:8.1f}" if name in rates and sec else " " * 8
            lines.append(f"  {name:<34} {sec:7.2f} {100 * sec / total:5.1f}% {rate}")
        per_step = 1e3 * self.seconds["engine step (Python)"] / max(steps, 1)
        lines.append(f"  {steps} steps; engine Python per step {per_step:.2f} ms")
        return lines


@contextmanager
def profiled(llm: Any) -> Iterator[OpProfile]:
    """Patch the engine of `llm` (and the layer modules) for the duration of the block."""
    from shoal.engine import model_runner
    from shoal.layers import attention, linear
    from shoal.layers.cpu_kernels import CpuKernels
    from shoal.layers.norm import RMSNorm
    from shoal.models import llama

    prof = OpProfile()
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    head = model.lm_head
    patches: list[tuple[Any, str, Any]] = [
        (engine, "step", "engine step (Python)"),
        (runner, "execute", "runner: inputs, metadata, glue"),
        (model, "forward", "embedding, layer glue"),
        (model_runner, "sample", "sampling"),
        (RMSNorm, "forward", "norms + residual adds"),
        (RMSNorm, "add_forward", "norms + residual adds"),
        (CpuKernels, "silu_mul", "SiLU x up"),
        (linear.GateUpProjection, "forward", "projections"),
        (llama, "rope_and_store", "rotary + KV writes"),
        (llama, "paged_attention", "attention glue"),
        (attention, "prefill_attention", "attention prefill"),
        (CpuKernels, "paged_decode", "attention decode"),
        (CpuKernels, "paged_prefill", "attention prefill"),
        (attention, "_gathered_decode", "attention decode"),
        (
            linear.Linear,
            "forward",
            lambda self, *a: "lm head" if self is head else "projections",
        ),
    ]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    for obj, name, kind in patches:
        setattr(obj, name, prof.wrap(kind, getattr(obj, name)))
    timed_execute = runner.execute

    def execute(batch: Any) -> Any:
        """Count the FLOPs of the schedule actually run."""
        prof.steps += 1
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            prof.flops.add_chunk(model.config, start, n, sampled=start + n == seq.num_tokens)
        return timed_execute(batch)

    runner.execute = execute
    try:
        yield prof
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def onednn_kernel(dtype: str) -> str:
    """The implementation oneDNN picks for a packed product in `dtype` on this CPU, as its
    verbose log names it (`brg_matmul:avx512_core_bf16` on a Zen 4), from a child process."""
    code = (
        "import torch\n"
        f"w = torch.ones(64, 64, dtype=torch.{dtype})\n"
        "p = torch.ops.mkldnn._reorder_linear_weight(w, 8)\n"
        "torch.ops.mkldnn._linear_pointwise(w[:8].contiguous(), p, None, 'none', [], '')\n"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    ).stdout
    for line in out.splitlines():
        fields = line.split(",")
        if "exec" in fields and "inner_product" in fields:
            return fields[fields.index("inner_product") + 1]
    return "not run"


def describe_paths(llm: Any) -> list[str]:
    """Which implementation each kind of op takes in this engine, on this CPU."""
    from shoal.layers import attention, cpu_kernels, linear
    from shoal.layers.cpu_features import native_bf16

    model = llm.engine.runner.model
    act, weight = model.act_dtype, model.lm_head.weight.dtype
    kv = model.attention_layers[0].k_cache.dtype
    kernels = cpu_kernels.native()
    isa = "none (pure torch)" if kernels is None else f"{kernels.isa} (-march=native)"
    path = {
        "gemm": "shoal's gemm.cpp (AVX2 + FMA)",
        "gemm512": "shoal's gemm512.cpp ("
        + ("VDPBF16PS" if act == torch.bfloat16 else "AVX-512 FMA")
        + "), SiLU x up in the gate-up epilogue",
        "torch": "torch F.linear",
    }.get(linear.projection_path(act, weight), "")
    if not path:
        path = f"oneDNN {onednn_kernel(str(act).removeprefix('torch.'))}"
    decode = kernels is not None and kernels.decodes(act, kv)
    prefill = kernels is not None and kernels.prefills(act, kv)
    block_size = model.attention_layers[0].k_cache.shape[1]
    prefill_tiles = " (float32 tiles, bf16 cache)"
    if kernels is not None and attention.bf16_prefill_tiles(kernels, block_size):
        prefill_tiles = " (AMX tiles)" if kernels.amx_tiles else " (VDPBF16PS tiles)"
    return [
        f"  activations {act}, weights {weight}, KV cache {kv}; C++ kernels: {isa}",
        f"  projections + LM head: {path}",
        "  decode attention: "
        + ("C++ paged kernel" if decode else "torch gather + SDPA")
        + (" (VDPBF16PS)" if decode and kv == act == torch.bfloat16 and native_bf16() else ""),
        "  prefill attention: "
        + ("C++ paged flash kernel" if prefill else "torch SDPA per chunk")
        + (prefill_tiles if prefill and act == torch.bfloat16 else ""),
        "  norms, rotary + KV writes (and SiLU x up unless fused): "
        + ("C++ fused kernels" if kernels is not None and kernels.elementwise(act) else "torch"),
    ]
