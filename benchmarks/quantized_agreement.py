"""Greedy agreement of quantized weights on W1's requests, against two references.

W1's prompts (`shoal.bench.w1_workload`: 64 requests of 32-512 random tokens, 128 greedy
tokens out, EOS ignored) run on one GGUF file three ways:
- shoal, `quantization="gguf"`: the weights in their blocks, integer products with
  `--activations` (two int8 levels by default), the fused decode step, a `--kv` KV cache;
- shoal in float64 with the file dequantized at load by the `gguf` package (no quantized
  code of shoal's): the exact arithmetic on the same weights;
- llama.cpp's `llama-server` on the same file (its own quantized products: activations in one
  int8 level), if `--llamacpp`.
llama.cpp's build (`benchmarks/setup_llamacpp.sh`) also writes the requantized files.
Prints how many of the requests' outputs equal each other's in full, and for those that do
not, the first position where they part (a near-tie flips there; later tokens follow the new
prefix).

    .venv/bin/python benchmarks/quantized_agreement.py [--file smollm2-Q4_1] [--llamacpp]
        [--num-requests 64] [--max-tokens 128] [--activations int16|int8] [--kv float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import gguf_files
import llamacpp_peer
import torch

from shoal import LLM, SamplingParams
from shoal.bench import Workload, w1_workload

REPO = Path(__file__).resolve().parent.parent
Outputs = list[list[int]]


def run_shoal(model: Path, work: Workload, **kw: Any) -> Outputs:
    llm = LLM(str(model), enable_prefix_caching=False, **kw)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    print(f"shoal {kw}: {time.perf_counter() - start:.0f} s", flush=True)
    return [o.token_ids for o in outs]


def compare(name: str, a: Outputs, b: Outputs) -> None:
    parted = [
        next(i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y)
        for p, q in zip(a, b, strict=True)
        if p != q
    ]
    print(f"{name}: {len(a) - len(parted)}/{len(a)} equal", end="")
    print(f"; the others part at tokens {sorted(parted)}" if parted else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--file", default="smollm2-Q4_1", help="a name gguf_files.py knows")
    ap.add_argument("--llamacpp", action="store_true", help="also llama-server on the file")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--activations", choices=["int16", "int8"], default="int16")
    ap.add_argument("--kv", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    root = llamacpp_peer.setup(REPO)  # builds once; requantized files are written there
    model = gguf_files.files(root, [args.file])[args.file]
    work = w1_workload(49152, args.num_requests, args.max_tokens)
    quantized = run_shoal(
        model, work, quantization="gguf", quantized_activations=args.activations, dtype=args.kv
    )
    reference = run_shoal(model, work, dtype="float64")
    print(f"\n{model.name}, {len(work.prompts)} W1 requests x {work.max_tokens} greedy tokens")
    compare(f"shoal quantized ({args.activations}, {args.kv} KV) vs float64", quantized, reference)
    if args.llamacpp:
        threads = torch.get_num_threads()
        peer = llamacpp_peer.run(root, model, work.prompts, work.max_tokens, threads)
        print(f"llama.cpp {root.name}: {' '.join(peer.command[1:])}")
        compare("shoal quantized vs llama.cpp", quantized, peer.outputs)
        compare("llama.cpp vs float64", peer.outputs, reference)


if __name__ == "__main__":
    main()
