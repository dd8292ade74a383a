"""Where a batch-1 decode step's CPU time goes: kernels or Python dispatch, by `perf`.

One request (a `--prompt`-token random prompt, `--tokens` greedy tokens) on the bundled model,
in the configuration named: `float32` (the GGUF dequantized at load, the per-op path: a
Python call per op, C++ kernels under it), `gguf` (weights in their blocks, the fused C++ decode
step) or `gguf-per-op` (the same weights, the fused step off). The prompt is prefilled first;
`perf record` is attached for the decode steps only and reports CPU samples by shared object:
shoal's kernel library, libgomp (OpenMP's threads waking and waiting), libtorch (ATen ops
and their dispatch), the Python interpreter, and the rest (libc, the kernel). Needs `perf`.

    .venv/bin/python benchmarks/decode_profile.py float32|gguf|gguf-per-op
        [--prompt 512] [--tokens 256]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import tempfile
import time
from collections import defaultdict

from shoal import LLM, SamplingParams

GROUPS = {
    "shoal-cpu-": "shoal's C++ kernels",
    "libgomp": "OpenMP runtime (wake-ups, barriers)",
    "libtorch": "libtorch (ATen ops, dispatch)",
    "libc10": "libtorch (ATen ops, dispatch)",
    "python": "Python interpreter",
    "libffi": "ctypes (libffi)",
    "_ctypes": "ctypes (libffi)",
}


def by_group(report: str) -> dict[str, float]:
    """Sample shares from `perf report --sort dso`, summed into GROUPS."""
    shares: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if m:
            name = next((g for k, g in GROUPS.items() if k in m.group(2)), "other (libc, kernel)")
            shares[name] += float(m.group(1))
    return dict(shares)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("config", choices=["float32", "gguf", "gguf-per-op"])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    quantized = args.config != "float32"
    llm = LLM(
        quantization="gguf" if quantized else None,
        dtype="bfloat16" if quantized else "float32",  # the KV cache small_batch.py uses
        enable_prefix_caching=False,
    )
    if args.config == "gguf-per-op":
        llm.engine.runner.model.fused = None
    engine = llm.engine
    rng = random.Random(0)
    prompt = [rng.randint(100, 40000) for _ in range(args.prompt)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    engine.step()  # the prefill, not profiled
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        cmd = ["perf", "record", "-F", "4999", "-p", str(os.getpid()), "-o", data]
        perf = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches
        start, steps = time.perf_counter(), 0
        while not any(o.finished for o in engine.step()):
            steps += 1
        wall = time.perf_counter() - start
        perf.send_signal(signal.SIGINT)
        perf.wait()
        report = subprocess.run(
            ["perf", "report", "-i", data, "--sort", "dso", "--stdio"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    print(f"{args.config}: {steps} decode steps, {steps / wall:.1f} tok/s")
    for name, share in sorted(by_group(report).items(), key=lambda kv: -kv[1]):
        print(f"  {share:5.1f}%  {name}")


if __name__ == "__main__":
    main()
