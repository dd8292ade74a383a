"""Random Q4_K and Q6_K tensors as a GGUF file holds them (gguf-py dequantizes K-quants but
does not quantize to them): random values and sub-block scales under float16 super-block
scales of a weight's usual size."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

BYTES = {"q4_k": 144, "q6_k": 210}  # a 256-value super-block
TYPES = {"q4_k": GGMLQuantizationType.Q4_K, "q6_k": GGMLQuantizationType.Q6_K}


def random_kquant(
    name: str, n: int, k: int, seed: int = 0, scale: float = 1.0, jitter: bool = False
) -> np.ndarray:
    """`[n, k / 256 * bytes]` uint8 with super-block scales of `scale` (×2⁻¹⁰ for Q4_K's d,
    ×2⁻⁷ for its dmin, ×2⁻⁸ for Q6_K's d), each drawn from ½–2× of that with `jitter`: without
    it and with `scale` a power of two, every block's scale is exact in float16 after repacking."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, BYTES[name]), dtype=np.uint8)
    size = scale * (rng.uniform(0.5, 2.0, (n, k // 256)) if jitter else np.ones((n, k // 256)))
    if name == "q4_k":
        blocks[..., 0:2] = (size * 2**-10).astype(np.float16)[..., None].view(np.uint8)
        blocks[..., 2:4] = (size * 2**-7).astype(np.float16)[..., None].view(np.uint8)
    else:
        blocks[..., 208:210] = (size * 2**-8).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def equal_scale_pairs(raw: np.ndarray) -> np.ndarray:
    """Q6_K bytes whose two 16-value sub-blocks of each 32 share one scale."""
    sb = raw.copy().reshape(-1, 210)
    sb[:, 193:208:2] = sb[:, 192:208:2]
    return sb.reshape(raw.shape)
