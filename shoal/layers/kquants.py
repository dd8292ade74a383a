"""GGUF's K-quants kept quantized: a Q4_K or Q6_K super-block (256 values) becomes eight of
shoal's 32-value blocks, so the Q4_1 and Q8_0 products run them (`quant_formats.py`).

Q4_K → Q4_1: a 32-value sub-block has 4-bit values, a 6-bit scale `sc` and a 6-bit min `m`
under the super-block's float16 `d` and `dmin`; it becomes a block with scale d·sc and min
−dmin·m, rounded to float16 (at most 2⁻¹¹ of the scale off), its nibbles kept as they are.

Q6_K → Q8_0: a 32-value block spans two 16-value sub-blocks with int8 scales a and b, so its
values are integers x = q·s times `d`. With g = gcd(a, b) the block stores x / g under the
scale d·g when that fits int8 (exact, but for float16), else x requantized to max |x| / 127:
at most an eighth of the coarser sub-block's Q6_K step off.

In memory Q4_K costs 5 bits a weight instead of 4.5, Q6_K 8.5 instead of 6.56; both stay
integer products, never a full-precision copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf.quants import Q4_K

from shoal.layers.quant_formats import BLOCK, FORMATS, QuantizedWeight, from_gguf_blocks

QK_K = 256  # values in a super-block
SUB = QK_K // BLOCK  # shoal blocks in a super-block


def _super_blocks(raw: np.ndarray, k: int, nbytes: int) -> np.ndarray:
    if k % QK_K:
        raise ValueError(f"a K-quant row holds whole {QK_K}-value super-blocks, not {k} values")
    return np.ascontiguousarray(raw).reshape(-1, nbytes)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """`[..., blocks]` floats as float16 bytes `[..., blocks, 2]`."""
    return values.astype(np.float16)[..., None].view(np.uint8)


def q4_k_as_q4_1(raw: np.ndarray, k: int) -> QuantizedWeight:
    """A Q4_K tensor's bytes `[n, k / 256 * 144]` as Q4_1 blocks."""
    sb = _super_blocks(raw, k, 144)
    d = sb[:, 0:2].view(np.float16).astype(np.float32)
    dmin = sb[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(sb[:, 4:16])  # [S, 8] each
    qs = sb[:, 16:].reshape(-1, 4, 1, 32)  # 32 bytes serve two sub-blocks: low, high nibbles
    q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, SUB, BLOCK)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # Q4_1: value i low, value i + 16 high
    scale, low = _f16_bytes(d * sc), _f16_bytes(-dmin * m)
    blocks = np.concatenate([scale, low, nibbles], axis=-1)  # [S, 8, 20]
    return from_gguf_blocks(FORMATS["q4_1"], blocks.reshape(raw.shape[0], -1), k)


def q6_k_as_q8_0(raw: np.ndarray, k: int) -> QuantizedWeight:
    """A Q6_K tensor's bytes `[n, k / 256 * 210]` as Q8_0 blocks."""
    sb = _super_blocks(raw, k, 210)
    ql, qh = sb[:, :128], sb[:, 128:192]
    scales = sb[:, 192:208].view(np.int8).astype(np.int32)  # [S, 16], one per 16 values
    d = sb[:, 208:210].view(np.float16).astype(np.float32)
    # Each half of 128 values: 64 bytes of low nibbles (values 0-63 low, 64-127 high) and
    # 32 bytes of 2-bit high parts (value 32j + i at bits 2j of byte i).
    low = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((low & 0x0F).reshape(-1, QK_K) | ((high & 0x03).reshape(-1, QK_K) << 4)).astype(np.int32)
    x = ((q - 32).reshape(-1, 16, 16) * scales[..., None]).reshape(-1, SUB, BLOCK)
    g = np.gcd(scales[:, 0::2], scales[:, 1::2])  # [S, 8]
    g = np.where(g == 0, 1, g)[..., None]
    amax = np.abs(x).max(-1, keepdims=True)
    exact = amax <= 127 * g
    step = np.where(exact, g, np.maximum(amax, 1) / 127)
    values = np.where(exact, x // g, np.round(x / step)).astype(np.int8).view(np.uint8)
    blocks = np.concatenate([_f16_bytes(d * step[..., 0]), values], axis=-1)
    return from_gguf_blocks(FORMATS["q8_0"], blocks.reshape(raw.shape[0], -1), k)


# GGUF tensor type name → the repacking that keeps it quantized.
KQUANTS: dict[str, Callable[[np.ndarray, int], QuantizedWeight]] = {
    "q4_k": q4_k_as_q4_1,
    "q6_k": q6_k_as_q8_0,
}
