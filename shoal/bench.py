"""Workload W1 (issue 2) and its honest accounting (issue 11).

W1: 64 requests, prompts of 32-512 tokens, 128 tokens out, EOS ignored. The accounting counts
the useful floating-point operations of what an engine computed (every projection, the LM head
on the rows that are sampled, causal attention over the positions each query can see) and
puts the achieved rate next to the CPU's peak, computed from what `lscpu` reports: achieved
above peak means the accounting is wrong.
"""

from __future__ import annotations

import platform
import random
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.models.config import ModelConfig
from shoal.sampling_params import SamplingParams


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


def w1_workload(vocab_size: int, num_requests: int = 64, max_tokens: int = 128) -> Workload:
    """Prompt lengths uniform in [32, 512] from `random.Random(0)`; token ids drawn the same way."""
    rng = random.Random(0)
    lengths = [rng.randint(32, 512) for _ in range(num_requests)]
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, max_tokens)


@dataclass(slots=True)
class Flops:
    """Useful FLOPs (multiply and add counted apart), by kind."""

    projections: float = 0.0
    lm_head: float = 0.0
    attention_prefill: float = 0.0
    attention_decode: float = 0.0

    @property
    def total(self) -> float:
        return self.projections + self.lm_head + self.attention_prefill + self.attention_decode

    def add_chunk(self, cfg: ModelConfig, start: int, num_tokens: int, sampled: bool) -> None:
        """Count positions `[start, start + num_tokens)` of one sequence run in one step."""
        h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
        q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
        per_token = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
        self.projections += per_token * num_tokens
        self.lm_head += 2.0 * h * cfg.vocab_size * sampled
        # Position p attends to p + 1 keys: q.k and p.v, 2 FLOPs a multiply-add, every head.
        seen = num_tokens * start + num_tokens * (num_tokens + 1) // 2
        attn = 4.0 * layers * cfg.num_heads * d * seen
        if num_tokens == 1:
            self.attention_decode += attn
        else:
            self.attention_prefill += attn


def workload_flops(cfg: ModelConfig, work: Workload) -> Flops:
    """The FLOPs of W1 as any engine must compute it: each prompt whole, then one token a step
    (the first output token comes from the prompt's last row)."""
    flops = Flops()
    for prompt in work.prompts:
        flops.add_chunk(cfg, 0, len(prompt), sampled=True)
        for i in range(work.max_tokens - 1):
            flops.add_chunk(cfg, len(prompt) + i, 1, sampled=True)
    return flops


@dataclass(slots=True)
class CpuInfo:
    model: str
    family: str
    model_id: str
    cores: int
    mhz: float
    mhz_source: str
    flop_per_cycle: int  # float32, per core
    flags: set[str] = field(default_factory=set)

    @property
    def peak_gflops(self) -> float:
        """float32 peak of all cores: cores x FLOP/cycle x clock."""
        return self.cores * self.flop_per_cycle * self.mhz / 1e3

    @property
    def bf16_speedup(self) -> int:
        """bfloat16 products per float32 FMA: AMX-BF16 tiles do 16x a core's AVX-512 FMAs;
        VDPBF16PS multiplies pairs, 2x; without either, bfloat16 runs widened, 1x."""
        return 16 if "amx_bf16" in self.flags else 2 if "avx512_bf16" in self.flags else 1

    def peak_for(self, dtype: str) -> float:
        """The peak GFLOP/s products of `dtype` can reach on all cores."""
        return self.peak_gflops * (self.bf16_speedup if dtype == "bfloat16" else 1)

    def describe(self) -> str:
        isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in self.flags]
        bf16 = f", bfloat16 {self.peak_for('bfloat16'):.0f}" if self.bf16_speedup > 1 else ""
        return (
            f"{self.model} (family {self.family}, model {self.model_id}), {self.cores} cores, "
            f"{'+'.join(isa) or 'no avx2'}; float32 peak {self.cores} x {self.flop_per_cycle} "
            f"FLOP/cycle x {self.mhz:.0f} MHz ({self.mhz_source}) = {self.peak_gflops:.0f} "
            f"GFLOP/s{bf16}"
        )


def _flop_per_cycle(vendor: str, family: int, flags: set[str]) -> int:
    """float32 FLOP per cycle per core: 2 FMA pipes x lanes x 2. AMD before Zen 5 (family 26)
    runs 512-bit operations on 256-bit pipes, so AVX-512 does not raise its peak."""
    wide = "avx512f" in flags and not (vendor == "AuthenticAMD" and family < 26)
    if "fma" in flags:
        return 64 if wide else 32
    return 16 if "avx" in flags else 8


# A chain of dependent register-register adds retires one a cycle on any x86-64 core, so adds
# per second is the clock the core actually runs at (boost included), which a VM's lscpu often
# does not report. Not `add $1`: Intel's Golden Cove (Sapphire/Emerald Rapids) folds chains of
# add-immediate at rename, several a cycle, which read as a 12 GHz clock.
_CLOCK_PROBE = r"""
#include <stdio.h>
#include <time.h>
int main(void) {
  double best = 0;
  for (int rep = 0; rep < 50; ++rep) {
    struct timespec a, b;
    unsigned long x = 0, one = 1;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < 2000000; ++i)
      __asm__ volatile("add %1,%0\n\tadd %1,%0\n\tadd %1,%0\n\tadd %1,%0\n\t"
                       "add %1,%0\n\tadd %1,%0\n\tadd %1,%0\n\tadd %1,%0" : "+r"(x) : "r"(one));
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
    if (16e6 / s / 1e6 > best) best = 16e6 / s / 1e6;
  }
  printf("%.0f\n", best);
  return 0;
}
"""


def measured_mhz() -> float | None:
    """The clock of a busy core, measured (x86-64 with a C compiler only); best of 50 short runs."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "clock.c", Path(tmp) / "clock"
        src.write_text(_CLOCK_PROBE)
        try:
            subprocess.run([cc, "-O1", str(src), "-o", str(exe)], check=True, capture_output=True)
            out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    return float(out)


def cpu_info() -> CpuInfo:
    """What `lscpu` says (Linux). The clock is lscpu's max MHz; where it gives none (as in many
    VMs), the measured clock of a busy core, else /proc/cpuinfo's nominal one."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    facts = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in out.splitlines())
    )
    flags = set(facts.get("Flags", "").split())
    cores = int(facts.get("Core(s) per socket", "1")) * int(facts.get("Socket(s)", "1"))
    mhz, source = float(facts.get("CPU max MHz", "0") or 0), "lscpu max MHz"
    if not mhz:
        mhz, source = measured_mhz() or 0, "measured: no max MHz in lscpu"
    if not mhz:
        text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        found = re.findall(r"cpu MHz\s*:\s*([\d.]+)", text)
        mhz, source = (max(map(float, found)), "/proc/cpuinfo, no max MHz") if found else (0, "?")
    family = facts.get("CPU family", "?")
    return CpuInfo(
        model=facts.get("Model name", "unknown CPU"),
        family=family,
        model_id=facts.get("Model", "?"),
        cores=cores,
        mhz=mhz,
        mhz_source=source,
        flop_per_cycle=_flop_per_cycle(
            facts.get("Vendor ID", ""), int(family) if family.isdigit() else 0, flags
        ),
        flags=flags,
    )


def run_w1(model: str | None = None, dtype: str = "float32", num_requests: int = 64) -> float:
    """Run W1 on shoal and print output tokens per second and GFLOP/s; returns the rate."""
    from shoal.engine.llm_engine import Engine
    from shoal.llm import LLM

    llm = LLM(model, dtype=dtype)
    assert isinstance(llm.engine, Engine)  # W1 measures the torch engine
    cfg = llm.engine.model_config
    work = w1_workload(cfg.vocab_size, num_requests)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    rate = generated / elapsed
    gflops = workload_flops(cfg, work).total / elapsed / 1e9
    print(f"shoal: {generated} output tokens in {elapsed:.1f} s = {rate:.1f} tokens/s")
    print(f"       {gflops:.1f} GFLOP/s on {cpu_info().describe()}")
    return rate
