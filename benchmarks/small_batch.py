"""Small batches: shoal against llama.cpp on the same GGUF file, the same threads, one run.

For each file (`gguf_files.py`: the bundled Q4_1 SmolLM2-135M, its Q4_0/Q8_0
requantizations, a random Llama-shaped ~1B model), and each repetition, llama.cpp then shoal,
interleaved so both see the same machine:
- llama.cpp: `llama-batched-bench -npp P -ntg N -npl B1,B2,...` (flash attention, one KV
  stream per sequence, F16 KV cache): its prefill and decode rates per batch size.
- shoal: a child process loads the file with `quantization="gguf"` (weights in their blocks,
  float32 activations, a bfloat16 KV cache by default) and for each B runs B requests of P
  distinct random tokens and N greedy tokens, all prompts in one step, then decodes: prefill
  rate and time to first token from the first step, decode rate from the rest (what
  batched-bench's T_PP and T_TG time). At B = 1 it also decodes with the per-op path (the
  fused C++ step off), and times the share of a fused step spent outside the C++ calls.
- RSS: peak resident memory of each engine's process (shoal's also after loading), and the
  weights' bytes by format.
- The bandwidth ceiling: this machine's read bandwidth (a sum over 1 GiB with the same
  threads) over the bytes a batch-1 step reads (weights as stored plus the KV cache at the
  mean context).
The median of the repetitions is printed, with the ratios.

    .venv/bin/python benchmarks/small_batch.py [--files smollm2-Q4_1,smollm2-Q4_0,...]
        [--batches 1,2,4,16,64] [--prompt 512] [--tokens 128] [--reps 3]
        [--activations int16|int8] [--kv bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf_files
import llamacpp_peer
import torch

from shoal.bench import cpu_info

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FILES = "smollm2-Q4_1,smollm2-Q4_0,smollm2-Q8_0,random1b-Q4_0"


def _status_mib(field: str, pid: int | str = "self") -> float:
    """A memory line of /proc/<pid>/status (VmRSS: resident now, VmHWM: its peak), MiB. (Not
    ru_maxrss, which a child inherits from the process that forked it.)"""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _batch(llm: Any, batch: int, prompt: int, tokens: int, seed: int) -> dict[str, float]:
    """One batch through the engine's steps: prefill (all prompts in the first step), decode."""
    from shoal import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    prompts = [[rng.randint(100, 40000) for _ in range(prompt)] for _ in range(batch)]
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first: float | None = None
    started: set[str] = set()
    done = 0
    while done < batch:
        outs = engine.step()
        started.update(o.request_id for o in outs if o.token_ids)
        if first is None and len(started) == batch:
            first = time.perf_counter()
        done += sum(o.finished for o in outs)
    end = time.perf_counter()
    assert first is not None
    return {
        "prefill": batch * prompt / (first - start),
        "ttft": first - start,
        "decode": batch * (tokens - 1) / (end - first),
    }


def _fused_share(llm: Any, prompt: int, tokens: int) -> float:
    """The share of batch-1 decode wall time spent in the fused C++ step and the LM head."""
    model = llm.engine.runner.model
    fused, head = model.fused, model.compute_logits
    spent = [0.0]

    def timed(fn: Any) -> Any:
        def call(*a: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[0] += time.perf_counter() - t

        return call

    model.fused, model.compute_logits = timed(fused), timed(head)
    try:
        out = _batch(llm, 1, prompt, tokens, seed=7)
    finally:
        model.fused, model.compute_logits = fused, head
    # The prefill step's head call is in `spent` too; it is one of `tokens` calls.
    decode_wall = (tokens - 1) / out["decode"]
    return min(1.0, spent[0] * (tokens - 1) / tokens / decode_wall)


def _kernels() -> str:
    """Which build of the C++ kernels ran (`SHOAL_CPU_TARGET` picks another than native)."""
    from shoal.layers import cpu_kernels, quant_kernels

    k = cpu_kernels.native()
    if k is None:
        return "none (pure torch)"
    tiles = ", AMX-INT8 tiles" if k.amx_int8 else ""
    return f"-march={k.march}: {quant_kernels.isa(k)} quantized products{tiles}"


def shoal_worker(args: argparse.Namespace) -> None:
    from shoal import LLM

    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    before = _status_mib("VmRSS")
    llm = LLM(
        args.model,
        quantization="gguf",
        quantized_activations=args.activations,
        dtype=args.kv,
        enable_prefix_caching=False,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches) * (args.prompt + 1)),
        # The pool the largest batch needs (it is resident: RSS counts it), as llama.cpp's -c.
        num_blocks=max(batches) * -(-(args.prompt + args.tokens + 16) // 16) + 8,
    )
    _batch(llm, 1, 16, 4, seed=1)  # warm-up: kernels, first-call allocations
    loaded = _status_mib("VmRSS")
    kv_size = torch.tensor([], dtype=getattr(torch, args.kv)).element_size()
    result: dict[str, Any] = {
        "rss_loaded_mib": loaded - before,
        "kv_bytes_per_token": llm.engine.model_config.kv_bytes_per_token(kv_size),
        "weight_bytes": llm.stats().weight_bytes,
        "fused": llm.engine.runner.model.fused is not None,
        "kernels": _kernels(),
        "batches": {str(b): _batch(llm, b, args.prompt, args.tokens, seed=b) for b in batches},
    }
    if result["fused"]:
        result["fused_share"] = _fused_share(llm, args.prompt, args.tokens)
        llm.engine.runner.model.fused = None
        result["per_op_decode"] = _batch(llm, 1, args.prompt, args.tokens, seed=1)["decode"]
    result["rss_peak_mib"] = _status_mib("VmHWM")
    print(json.dumps(result))


def run_shoal(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--model", str(model)]
    for name in ("batches", "prompt", "tokens", "activations", "kv", "threads"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'benchmarks'}"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def run_llamacpp(args: argparse.Namespace, root: Path, model: Path) -> dict[str, Any]:
    batches = [int(b) for b in args.batches.split(",")]
    threads = args.threads
    cmd = [
        str(root / "build" / "bin" / "llama-batched-bench"),
        *("-m", str(model)),
        *("-c", str(max(batches) * (args.prompt + args.tokens + 16))),
        *("-npp", str(args.prompt), "-ntg", str(args.tokens), "-npl", args.batches),
        *("-t", str(threads), "-tb", str(threads)),
        *("-fa", "on", "-no-kvu"),
    ]
    text, peak, rc = _run_peak(cmd)
    if llamacpp_peer.without_repack(cmd, rc):
        text, peak, rc = _run_peak(cmd)
    if rc:
        raise RuntimeError(f"llama-batched-bench failed ({rc}): {cmd}")
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("|")]
    per_batch = {}
    for row in rows:
        cells = [c.strip() for c in row]
        if cells and cells[2].isdigit():
            per_batch[cells[2]] = {
                "prefill": float(cells[5]),
                "ttft": float(cells[4]),
                "decode": float(cells[7]),
            }
    return {"batches": per_batch, "rss_peak_mib": peak, "command": cmd}


def _run_peak(cmd: list[str]) -> tuple[str, float, int]:
    """`cmd`'s stdout, its peak RSS in MiB and its exit status."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, text=True)
        peak = 0.0
        while proc.poll() is None:  # the peak so far, until it exits
            try:
                peak = max(peak, _status_mib("VmHWM", proc.pid))
            except OSError:
                break
            time.sleep(0.2)
        out.seek(0)
        return out.read(), peak, proc.wait()


def read_bandwidth() -> float:
    """GB/s of a sum over 1 GiB with torch's threads (the best of five)."""
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    return (1 << 30) / best / 1e9


def _median(runs: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for run in runs:
        v: Any = run
        for k in keys:
            v = v[k]
        values.append(float(v))
    return statistics.median(values)


Runs = list[dict[str, Any]]


def report(args: argparse.Namespace, name: str, peer: Runs, ours: Runs, bandwidth: float) -> None:
    print(f"\n== {name} ==")
    sizes = ours[0]["weight_bytes"]
    listed = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(sizes.items()))
    print(f"  shoal weights: {listed}")
    print(f"  {'B':>3} {'llama.cpp tok/s':>16} {'shoal tok/s':>12} {'ratio':>6}")
    for b in args.batches.split(","):
        lc, sh = _median(peer, "batches", b, "decode"), _median(ours, "batches", b, "decode")
        print(f"  {b:>3} {lc:16.1f} {sh:12.1f} {sh / lc:6.2f}x")
    b1 = args.batches.split(",")[0]
    lc_pp, sh_pp = _median(peer, "batches", b1, "prefill"), _median(ours, "batches", b1, "prefill")
    print(
        f"  prefill ({args.prompt} tokens, B={b1}): llama.cpp {lc_pp:.0f} tok/s, "
        f"shoal {sh_pp:.0f} tok/s, {sh_pp / lc_pp:.2f}x"
    )
    lc_t, sh_t = _median(peer, "batches", b1, "ttft"), _median(ours, "batches", b1, "ttft")
    print(
        f"  TTFT ({args.prompt} tokens): llama.cpp {1e3 * lc_t:.0f} ms, shoal {1e3 * sh_t:.0f} ms"
    )
    print(
        f"  peak RSS: llama.cpp {_median(peer, 'rss_peak_mib'):.0f} MiB, shoal "
        f"{_median(ours, 'rss_peak_mib'):.0f} MiB (after loading: "
        f"{_median(ours, 'rss_loaded_mib'):.0f} MiB)"
    )
    if ours[0].get("fused"):
        per_op, fused = _median(ours, "per_op_decode"), _median(ours, "batches", b1, "decode")
        share = _median(ours, "fused_share")
        print(
            f"  B={b1} decode: per-op path {per_op:.1f} tok/s, fused step {fused:.1f} tok/s "
            f"({fused / per_op:.2f}x); {100 * share:.0f}% of a fused step's wall time in C++ "
            f"(fused layers + LM head), {100 * (1 - share):.0f}% in Python"
        )
    weights = sum(sizes.values())
    context = args.prompt + args.tokens // 2
    kv = ours[0].get("kv_bytes_per_token", 0) * context
    ceiling = bandwidth * 1e9 / (weights + kv)
    sh1 = _median(ours, "batches", b1, "decode")
    print(
        f"  B={b1} bandwidth ceiling: {bandwidth:.1f} GB/s / {(weights + kv) / 1e6:.0f} MB a token "
        f"= {ceiling:.0f} tok/s; shoal at {100 * sh1 / ceiling:.0f}% of it"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--files", default=DEFAULT_FILES)
    ap.add_argument("--batches", default="1,2,4,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--activations", choices=["int16", "int8"], default="int16")
    ap.add_argument("--kv", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        shoal_worker(args)
        return
    torch.set_num_threads(args.threads)
    root = llamacpp_peer.setup(REPO)
    files = gguf_files.files(root, args.files.split(","))
    bandwidth = read_bandwidth()
    peer: dict[str, list[dict[str, Any]]] = {name: [] for name in files}
    ours: dict[str, list[dict[str, Any]]] = {name: [] for name in files}
    for rep in range(args.reps):
        for name, path in files.items():
            peer[name].append(run_llamacpp(args, root, path))
            ours[name].append(run_shoal(args, path))
            print(f"rep {rep + 1}/{args.reps} {name} done", flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    print("\n" + next((line for line in lscpu if line.startswith("Model name")), "lscpu: ?"))
    print(f"CPU: {cpu_info().describe()}")
    print(f"threads: {args.threads} (torch; llama.cpp -t/-tb the same); read {bandwidth:.1f} GB/s")
    command = " ".join(peer[next(iter(files))][0]["command"][1:])
    kernels = ours[next(iter(files))][0]["kernels"]
    print(f"shoal: quantization='gguf', {args.activations} activations, {args.kv} KV cache")
    print(f"shoal's kernels: {kernels}")
    print(f"llama.cpp {root.name}: {command}")
    for name in files:
        report(args, name, peer[name], ours[name], bandwidth)


if __name__ == "__main__":
    main()
