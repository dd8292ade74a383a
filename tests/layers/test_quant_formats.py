"""GGUF blocks repacked into shoal's layout keep every weight: checked against gguf-py's own
dequantizer, row lookups, stacking, and shoal's quantizer of float weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from shoal.layers.quant_formats import FORMATS, QuantizedWeight, from_gguf_blocks, quantize

GGML = {
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}


def _gguf_tensor(name: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random `[n, k]` weight as gguf-py quantizes it: (raw block bytes, dequantized)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, GGML[name])
    return raw, quants.dequantize(raw, GGML[name])


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize(("n", "k"), [(8, 32), (21, 64), (64, 96)])
def test_repacked_blocks_dequantize_to_gguf_values(name: str, n: int, k: int) -> None:
    raw, expected = _gguf_tensor(name, n, k)
    packed = from_gguf_blocks(FORMATS[name], raw, k)
    assert (packed.n, packed.k) == (n, k)
    assert packed.data.shape == (-(-n // 8), k // 32, FORMATS[name].group_block_bytes)
    np.testing.assert_array_equal(packed.dequantize().numpy(), expected)
    # The packed layout costs what the file does, plus zero rows up to a whole group.
    assert packed.nbytes == -(-n // 8) * 8 * raw.shape[1]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rows_are_the_dequantized_rows(name: str) -> None:
    raw, expected = _gguf_tensor(name, 37, 64, seed=1)
    packed = from_gguf_blocks(FORMATS[name], raw, 64)
    index = torch.tensor([0, 7, 8, 36, 7, 19])
    np.testing.assert_array_equal(packed.rows(index).numpy(), expected[index.numpy()])


def test_stacked_weights_keep_their_rows_in_order() -> None:
    parts = [_gguf_tensor("q4_1", n, 64, seed=n) for n in (16, 8, 13)]
    packed = QuantizedWeight.cat([from_gguf_blocks(FORMATS["q4_1"], r, 64) for r, _ in parts])
    assert packed.n == 37
    np.testing.assert_array_equal(
        packed.dequantize().numpy(), np.concatenate([d for _, d in parts])
    )


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_float_weights_quantize_within_half_a_step(name: str) -> None:
    """shoal's quantizer (HF models' int8, the tests' random weights) rounds each value to
    its block's nearest level: at most half a scale away (Q4_0 clips its top level)."""
    w = torch.randn(24, 128, dtype=torch.float64)
    packed = quantize(w, FORMATS[name])
    err = (packed.dequantize(torch.float64) - w).abs().view(24, 4, 32)
    blocks = w.view(24, 4, 32)
    if name == "q8_0":
        step = blocks.abs().amax(-1) / 127
    elif name == "q4_1":
        step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    else:
        step = blocks.abs().amax(-1) / 8
    # Rounding the scale (and min) to float16 moves a value by at most 2^-11 of the block's
    # largest magnitude, times the few levels it is multiplied by.
    fp16 = blocks.abs().amax(-1) * 2e-3
    bound = (step * (0.5 if name != "q4_0" else 1.0) + fp16).unsqueeze(-1)
    assert (err <= bound).all()


def test_weights_that_are_not_whole_blocks_are_refused() -> None:
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        quantize(torch.randn(8, 40), FORMATS["q8_0"])
