"""W1 on one CUDA GPU: shoal (decode CUDA graphs, and eager) against transformers' own
continuous batching (`generate_batch`, paged KV), same process, same GPU, same prompts.

The model is SmolLM2-135M's shape with seeded random bfloat16 weights (the GPU machine has no
network and no GGUF reader), saved once as an HF folder both load. W1: prompt lengths uniform
in [32, 512] (`shoal.bench.w1_workload`), 128 tokens out, EOS ignored, greedy; at 64 and 256
requests. shoal first runs a few other prompts (kernel compiles), then `LLM.generate` over the
workload is timed; transformers' call is timed from its first request's creation to its last
one's end, so its manager's set-up and warm-up (its CUDA graph capture), like shoal's start-up,
are left out (the call's whole wall time is reported too).

Then one decode step at batch 64 (`gpu_step_profile.py`): wall time against the GPU's busy time
(the launch-overhead share), with graphs and without, and the step's HBM roofline.

    python3 benchmarks/gpu_w1.py [--out DIR] [--requests 64 256] [--skip-transformers]

Results go to DIR/gpu_w1.json (default: $OUT, else the current folder); a Markdown table is
printed for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_step_profile import hbm_bandwidth, profile_decode, roofline, step_bytes

from shoal import LLM, SamplingParams
from shoal.bench import Workload, w1_workload

SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MAX_TOKENS = 128


def build_model(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M))
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return folder


def warmup_prompts(vocab: int) -> list[list[int]]:
    """Prompts unlike W1's (no prefix-cache hit carries over into the timed run)."""
    rng = random.Random(1)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 300))] for _ in range(8)]


def gpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch_name": torch.cuda.get_device_name()}
    try:
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        )
        info["nvidia_smi"] = out.stdout.strip()
    except OSError as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    import transformers

    info["torch"] = torch.__version__
    info["transformers"] = transformers.__version__
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def shoal_llm(path: Path, requests: int, enforce_eager: bool) -> LLM:
    return LLM(
        str(path),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=requests,
        max_num_batched_tokens=8192,
        kv_cache_bytes=6 << 30,
        host_kv_bytes=0,
        enforce_eager=enforce_eager,
    )


def run_shoal(path: Path, work: Workload, enforce_eager: bool) -> dict[str, Any]:
    start = time.perf_counter()
    llm = shoal_llm(path, len(work.prompts), enforce_eager)
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(warmup_prompts(SMOLLM2_135M["vocab_size"]), params, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    llm.close()
    del llm
    _free()
    return {
        "tokens_per_s": sum(map(len, tokens)) / elapsed,
        "seconds": elapsed,
        "startup_s": startup,
        "outputs": tokens,
    }


def run_transformers(path: Path, work: Workload) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    config = GenerationConfig(
        max_new_tokens=work.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    results = model.generate_batch(work.prompts, config, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    outs = list(results.values())
    assert len(outs) == len(work.prompts), f"{len(outs)} of {len(work.prompts)} requests came back"
    tokens = [list(o.generated_tokens) for o in outs]
    created = [getattr(o, "created_time", None) for o in outs]
    ended = [getattr(o, "lifespan", (-1, -1))[1] for o in outs]
    generating = wall
    if all(c is not None for c in created) and all(e > 0 for e in ended):
        generating = max(ended) - min(c for c in created if c is not None)
    attn = getattr(model.config, "_attn_implementation", None)
    del model
    _free()
    return {
        "tokens_per_s": sum(map(len, tokens)) / generating,
        "seconds": generating,
        "call_wall_s": wall,
        "call_tokens_per_s": sum(map(len, tokens)) / wall,
        "attn_implementation": attn,
        "outputs": tokens,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Equal outputs, and the mean share of each output before the first difference."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
        prefix.append(n / max(1, len(x)))
    return {"equal_outputs": same / len(a), "mean_common_prefix": sum(prefix) / len(prefix)}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _attempt(name: str, errors: dict[str, str], fn: Any, *args: Any) -> Any:
    """Run one measurement; a failure is recorded and the rest of the run goes on."""
    try:
        return fn(*args)
    except Exception:
        errors[name] = traceback.format_exc()
        print(f"{name} failed:\n{errors[name]}", flush=True)
        _free()
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"gpu": gpu_info(), "w1": [], "decode_step": [], "errors": {}}
    errors = report["errors"]
    print(json.dumps(report["gpu"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "smollm2-shape")
        for n in args.requests:
            work = w1_workload(SMOLLM2_135M["vocab_size"], n, MAX_TOKENS)
            row: dict[str, Any] = {"requests": n}
            for label, eager in (("shoal_graphs", False), ("shoal_eager", True)):
                row[label] = _attempt(f"{label}@{n}", errors, run_shoal, path, work, eager)
            if not args.skip_transformers:
                row["transformers_cb"] = _attempt(f"hf@{n}", errors, run_transformers, path, work)
            _summarize(row)
            report["w1"].append(row)
            _write(out, report)
        work = w1_workload(SMOLLM2_135M["vocab_size"], 64, MAX_TOKENS)
        bandwidth = _attempt("hbm_bandwidth", errors, hbm_bandwidth)
        for eager in (False, True):
            label = "eager" if eager else "graphs"
            step = _attempt(f"decode_step_{label}", errors, _decode_step, path, work, eager)
            if step is not None and bandwidth:
                step["roofline"] = roofline(step.pop("bytes"), bandwidth, step)
            report["decode_step"].append({"mode": label, **(step or {})})
            _write(out, report)
    print(_table(report), flush=True)


def _decode_step(path: Path, work: Workload, enforce_eager: bool) -> dict[str, Any]:
    llm = shoal_llm(path, len(work.prompts), enforce_eager)
    llm.generate(warmup_prompts(SMOLLM2_135M["vocab_size"]), SamplingParams(max_tokens=4))
    step = profile_decode(llm, work.prompts)
    step["bytes"] = step_bytes(llm, step.pop("context_lens"))
    llm.close()
    del llm
    _free()
    return step


def _summarize(row: dict[str, Any]) -> None:
    """Ratios and agreement into the row; the token lists themselves are dropped."""
    graphs, eager, hf = row.get("shoal_graphs"), row.get("shoal_eager"), row.get("transformers_cb")
    if graphs and hf:
        row["shoal_over_transformers"] = graphs["tokens_per_s"] / hf["tokens_per_s"]
        row["bf16_agreement_with_transformers"] = agreement(graphs["outputs"], hf["outputs"])
    if graphs and eager:
        row["graphs_over_eager"] = graphs["tokens_per_s"] / eager["tokens_per_s"]
        row["graphs_agree_with_eager"] = agreement(graphs["outputs"], eager["outputs"])
    for result in (graphs, eager, hf):
        if result:
            result.pop("outputs", None)
    for label, result in (("shoal graphs", graphs), ("shoal eager", eager), ("transformers", hf)):
        if result:
            print(f"W1 {row['requests']}: {label} {result['tokens_per_s']:,.0f} tok/s", flush=True)


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_w1.json").write_text(json.dumps(report, indent=2))


def _fmt(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _table(report: dict[str, Any]) -> str:
    gpu = report["gpu"].get("nvidia_smi") or report["gpu"]["torch_name"]
    lines = [
        f"GPU: {gpu}",
        "",
        "| requests | shoal graphs tok/s | shoal eager tok/s | transformers CB tok/s | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report["w1"]:
        cells = [
            (row.get(key) or {}).get("tokens_per_s")
            for key in ("shoal_graphs", "shoal_eager", "transformers_cb")
        ]
        ratio = row.get("shoal_over_transformers")
        lines.append(
            f"| {row['requests']} | "
            + " | ".join(_fmt(c) for c in cells)
            + f" | {_fmt(ratio, '.2f')}x |"
        )
    lines += [
        "",
        "| decode step, batch 64 | wall ms | GPU busy ms | busy share | HBM floor ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for step in report["decode_step"]:
        floor = (step.get("roofline") or {}).get("floor_ms")
        lines.append(
            f"| {step['mode']} | {_fmt(step.get('step_wall_ms'), '.2f')} | "
            f"{_fmt(step.get('step_gpu_ms'), '.2f')} | {_fmt(step.get('gpu_busy_share'), '.0%')} "
            f"| {_fmt(floor, '.3f')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
