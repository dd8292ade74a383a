"""bfloat16 on the CPU: bf16 activations through oneDNN where the CPU multiplies bf16 natively,
bf16 weights under float32 activations in shoal's AVX2 kernel elsewhere, bf16 KV in both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal import LLM, SamplingParams
from shoal.layers import cpu_kernels, linear
from shoal.layers.cpu_features import native_bf16

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


def _has_bf16_weight_gemm() -> bool:
    kernels = cpu_kernels.native()
    return kernels is not None and kernels.has_gemm(torch.bfloat16)


def test_activation_dtype_follows_the_cpu(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", kv_cache_bytes=SMALL_KV)
    act = llm.engine.runner.model.act_dtype
    if linear.native_bf16_products():
        assert act == torch.bfloat16
        assert linear.projection_path(torch.bfloat16, torch.bfloat16) in ("gemm512", "onednn")
    elif _has_bf16_weight_gemm():
        assert act == torch.float32
        assert linear.projection_path(torch.float32, torch.bfloat16) == "gemm"
    else:
        assert act == torch.bfloat16
    assert linear.native_bf16_products() is (native_bf16() and linear.onednn_packs(torch.bfloat16))


def test_bf16_weights_run_with_float32_activations(tiny_model_dir, tmp_path, monkeypatch):
    """What it computes is float32 math on the bf16-rounded weights (KV rounding aside). The
    path CPUs without native bf16 take; on others it is forced, to test it where it runs."""
    if not _has_bf16_weight_gemm():
        pytest.skip("needs AVX2 + FMA and a compiler for shoal's kernel")
    monkeypatch.setattr(linear, "native_bf16_products", lambda: False)
    monkeypatch.setattr("shoal.engine.model_runner.native_bf16_products", lambda: False)
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


@pytest.mark.skipif(
    not linear.native_bf16_products(),
    reason="this CPU has no bf16 dot products (AVX512_BF16, AMX, Arm BF16) for oneDNN",
)
def test_native_bf16_matches_float64_on_the_same_weights(tiny_model_dir, tmp_path):
    """bf16 activations x bf16 weights (oneDNN's VDPBF16PS/AMX path, the C++ element-wise and
    attention kernels on bf16) give the log-probabilities of float64 math on the bf16-rounded
    weights, within bf16's rounding."""
    path = tiny_model_dir("qwen2")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_bytes=SMALL_KV)
    assert llm.engine.runner.model.act_dtype == torch.bfloat16
    reference = LLM(
        str(_rounded_to_bf16(path, tmp_path / "rounded")), dtype="float64", kv_cache_bytes=SMALL_KV
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    for got, want in zip(
        llm.generate(PROMPTS, params), reference.generate(PROMPTS, params), strict=True
    ):
        assert got.token_ids[0] == want.token_ids[0]
        assert got.logprobs is not None and want.logprobs is not None
        assert got.logprobs[0] == pytest.approx(want.logprobs[0], abs=0.1)


def test_bf16_without_the_kernels_runs_in_torch(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "native", lambda: None)
    monkeypatch.setattr(linear, "projection_path", lambda act, weight: "torch")
    llm = LLM(str(tiny_model_dir("qwen2")), dtype="bfloat16", kv_cache_bytes=SMALL_KV)
    assert llm.engine.runner.model.act_dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert all(0 <= t < 320 for o in outs for t in o.token_ids)
