"""bfloat16 on the CPU: bf16 weights and KV, float32 activations where the kernels run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal import LLM, SamplingParams
from shoal.layers import cpu_kernels

SMALL_KV = 8 << 20
PROMPTS = [[5, 6, 7], [8] * 20, list(range(30, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _rounded_to_bf16(src: Path, dst: Path) -> Path:
    """A copy of the model whose float64 weights hold exactly their bfloat16 values."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(torch.bfloat16).double() for k, v in tensors.items()}, f)
    return dst


@pytest.mark.skipif(not cpu_kernels.gemm_available(torch.bfloat16), reason="needs AVX2 + FMA")
def test_bf16_weights_run_with_float32_activations(tiny_model_dir, tmp_path):
    """What it computes is float32 math on the bf16-rounded weights (KV rounding aside)."""
    path = tiny_model_dir("qwen2")  # biases too
    llm = LLM(str(path), dtype="bfloat16", kv_cache_bytes=SMALL_KV)
    runner = llm.engine.runner
    assert runner.model.act_dtype == torch.float32
    assert runner.kv_caches()[0][0].dtype == torch.bfloat16
    reference = LLM(
        str(_rounded_to_bf16(path, tmp_path / "rounded")), dtype="float32", kv_cache_bytes=SMALL_KV
    )
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == [o.token_ids for o in reference.generate(PROMPTS, GREEDY)]


def test_bf16_without_the_kernels_runs_in_torch(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    llm = LLM(str(tiny_model_dir("qwen2")), dtype="bfloat16", kv_cache_bytes=SMALL_KV)
    assert llm.engine.runner.model.act_dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert all(0 <= t < 320 for o in outs for t in o.token_ids)
