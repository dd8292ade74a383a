"""W1 throughput: shoal's continuous batching against transformers' static batching, one run.

64 requests, prompt lengths uniform in [32, 512] (random.Random(0)), 128 output tokens each
with EOS ignored, the bundled SmolLM2-135M in float32 on the CPU. transformers runs
`generate()` on static batches of 16 with left padding. Prints each one's output tokens/s and
the ratio.

    .venv/bin/python benchmarks/w1_throughput.py [--num-requests 64] [--skip-peer]
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench import Workload, w1_workload
from shoal.models.loader import bundled_model_path


def run_shoal(work: Workload) -> tuple[float, list[list[int]]]:
    llm = LLM()
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, [o.token_ids for o in outs]


def run_transformers(work: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--peer-batch-size", type=int, default=16)
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()

    work = w1_workload(49152, args.num_requests, args.max_tokens)
    shoal_rate, shoal_out = run_shoal(work)
    print(f"shoal:        {shoal_rate:7.1f} output tokens/s")
    if args.skip_peer:
        return
    peer_rate, peer_out = run_transformers(work, args.peer_batch_size)
    same = sum(a == b for a, b in zip(shoal_out, peer_out, strict=True))
    print(
        f"transformers: {peer_rate:7.1f} output tokens/s (static batches of {args.peer_batch_size})"
    )
    print(f"ratio shoal / transformers: {shoal_rate / peer_rate:.2f}x")
    print(f"identical greedy outputs: {same}/{len(shoal_out)} (float32; ties may differ)")


if __name__ == "__main__":
    main()
