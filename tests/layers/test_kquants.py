"""Q4_K and Q6_K tensors repacked into Q4_1 and Q8_0 blocks hold the weights gguf-py
dequantizes from the file: exactly where the new scales are exact, else within the bounds the
module states."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from kquant_blocks import TYPES, equal_scale_pairs, random_kquant

from shoal import LLM, SamplingParams
from shoal.layers.kquants import KQUANTS, q4_k_as_q4_1, q6_k_as_q8_0
from shoal.layers.quant_formats import QuantizedWeight
from shoal.layers.quantized_linear import QuantizedLinear
from shoal.models.loader import load_model


def _reference(name: str, raw: np.ndarray) -> np.ndarray:
    return quants.dequantize(raw, TYPES[name]).astype(np.float64)


def _ours(packed_name: str, raw: np.ndarray, k: int) -> np.ndarray:
    return KQUANTS[packed_name](raw, k).dequantize().double().numpy()


@pytest.mark.parametrize(("n", "k"), [(8, 256), (13, 512), (24, 768)])
def test_q4_k_with_power_of_two_scales_is_exact(n: int, k: int) -> None:
    raw = random_kquant("q4_k", n, k)  # d·sc and dmin·m are exact in float16
    packed = q4_k_as_q4_1(raw, k)
    assert (packed.fmt.name, packed.n, packed.k) == ("q4_1", n, k)
    np.testing.assert_array_equal(_ours("q4_k", raw, k), _reference("q4_k", raw))


def test_q4_k_scales_round_to_float16_within_their_bound() -> None:
    raw = random_kquant("q4_k", 16, 512, seed=3, jitter=True)
    ref = _reference("q4_k", raw)
    err = np.abs(_ours("q4_k", raw, 512) - ref)
    # d·sc and dmin·m each rounded to float16: at most 2^-11 of 15·|d·sc| + |dmin·m|.
    sb = raw.reshape(-1, 144)
    d = sb[:, 0:2].view(np.float16).astype(np.float64)
    dmin = sb[:, 2:4].view(np.float16).astype(np.float64)
    bound = 2**-11 * (15 * d * 63 + dmin * 63)  # per super-block, the largest sc and m
    assert (err.reshape(-1, 256) <= bound + 1e-12).all()
    assert err.max() > 0  # the rounding is real: the bound, not luck, is what is checked


def test_q6_k_with_shared_sub_block_scales_is_exact() -> None:
    raw = equal_scale_pairs(random_kquant("q6_k", 8, 512, seed=1))
    packed = q6_k_as_q8_0(raw, 512)
    assert packed.fmt.name == "q8_0"
    np.testing.assert_array_equal(_ours("q6_k", raw, 512), _reference("q6_k", raw))


def test_q6_k_is_within_an_eighth_of_its_step() -> None:
    raw = random_kquant("q6_k", 16, 768, seed=2, jitter=True)
    ref = _reference("q6_k", raw).reshape(-1, 8, 32)
    err = np.abs(_ours("q6_k", raw, 768).reshape(-1, 8, 32) - ref)
    sb = raw.reshape(-1, 210)
    d = np.abs(sb[:, 208:210].view(np.float16).astype(np.float64))  # [S, 1]
    s = np.abs(sb[:, 192:208].view(np.int8).astype(np.float64)).reshape(-1, 8, 2).max(-1)
    # An eighth of the coarser sub-block's step, and the new scale's float16 rounding.
    bound = (1 / 8 + 1 / 64) * s * d
    assert (err.max(-1) <= bound + 1e-12).all()


@pytest.mark.parametrize("name", sorted(KQUANTS))
def test_rows_that_are_not_whole_super_blocks_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="super-blocks"):
        KQUANTS[name](np.zeros((8, 144), np.uint8), 128)


def _write_gguf_module() -> ModuleType:
    """`benchmarks/gguf_files.py`, loaded the way the benchmark scripts import it."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_files.py"
    spec = importlib.util.spec_from_file_location("gguf_files", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama GGUF as a Q4_K_M file has it: Q4_K projections, Q6_K `ffn_down` and the
    first layer's `attn_v` (so its q/k/v product is in two formats), a float16 embedding; every
    scale exact after repacking, so the file's own dequantized weights are the ones shoal's
    products use."""
    files = _write_gguf_module()
    rng = np.random.default_rng(0)

    def matrix(name: str, rows: int, cols: int) -> Any:
        if name == "token_embd.weight":
            return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)
        kind = "q6_k" if "ffn_down" in name or name == "blk.0.attn_v.weight" else "q4_k"
        raw = random_kquant(kind, rows, cols, seed=int(rng.integers(1 << 30)), scale=2**-4)
        return (equal_scale_pairs(raw) if kind == "q6_k" else raw), TYPES[kind]

    out = tmp_path_factory.mktemp("kquant") / "tiny-Q4_K_M.gguf"
    shape = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512}
    files.write_llama(out, shape, matrix, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    return out


def test_a_q4_k_m_file_stays_quantized_and_follows_float64_of_its_weights(
    kquant_model: Path,
) -> None:
    kept = load_model(str(kquant_model), "float32", "gguf").weights
    floats = load_model(str(kquant_model), "float32").weights  # gguf-py's dequantization
    for name, fmt in (("self_attn.q_proj", "q4_1"), ("mlp.down_proj", "q8_0")):
        w = kept[f"model.layers.1.{name}.weight"]
        assert isinstance(w, QuantizedWeight) and w.fmt.name == fmt
        torch.testing.assert_close(w.dequantize(), floats[f"model.layers.1.{name}.weight"])

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 40_000, 24)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    quantized = LLM(str(kquant_model), quantization="gguf", kv_cache_bytes=8 << 20)
    expected = LLM(str(kquant_model), dtype="float64", kv_cache_bytes=8 << 20)
    outs = zip(quantized.generate(prompts, params), expected.generate(prompts, params), strict=True)
    same = sum(a.token_ids == b.token_ids for a, b in outs)
    assert same >= 3, f"{same}/4 equal"  # int8 activations may flip a near-tie


def test_a_product_in_two_formats_stays_in_its_blocks_and_decodes_fused(
    kquant_model: Path,
) -> None:
    """The first layer's q/k/v are Q4_1 and Q8_0 blocks: one product of two runs, not a float
    weight, and the fused decode step (which takes runs) computes what the per-op path does."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [[int(t) for t in np.random.default_rng(2).integers(3, 40_000, 16)]] * 3
    fused = LLM(str(kquant_model), quantization="gguf", kv_cache_bytes=8 << 20)
    model = fused.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    assert [(w.fmt.name, w.n) for w in qkv.runs] == [("q4_1", 256 + 128), ("q8_0", 128)]
    assert model.fused is not None
    assert set(fused.stats().weight_bytes) == {
        "q4_1",
        "q8_0",
        "float32",
    }  # float32: norms, embedding
    per_op = LLM(str(kquant_model), quantization="gguf", kv_cache_bytes=8 << 20)
    per_op.engine.runner.model.fused = None
    a, b = fused.generate(prompts, params), per_op.generate(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-2)
