"""Weights kept quantized: GGUF's Q4_0, Q4_1 and Q8_0 blocks in the layout shoal's integer
products read (`csrc/quant_blocks.h` describes it), repacked once at load.

A weight block is 32 consecutive values of a row with a float16 scale (and for Q4_1 a min).
Rows are interleaved 8 at a time, so a kernel's 32-bit lane is one row; GGUF's own bytes of a
block are kept (Q4 nibbles are already split low/high the way the kernel reads them), only
reordered. An HF model's float weights quantize into Q8_0 blocks (`quantization="int8"`):
weight-only int8 with one scale per 32 values of each output channel, as llama.cpp's Q8_0.

Dequantizing (`dequantize`, `rows`) serves the float64 references of the tests, the embedding
lookup (a few rows per step) and the paths without the C++ kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # values along k sharing a scale
GROUP = 8  # rows interleaved in the packed layout


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str
    nibbles: bool  # 4-bit values, two to a byte
    mins: bool  # a float16 min per block (Q4_1)
    bias: int  # subtracted from the stored value (Q4_0's 8)

    @property
    def gguf_block_bytes(self) -> int:
        """Bytes of one block in a GGUF file: scale (and min), then values."""
        return 2 + 2 * self.mins + (BLOCK // 2 if self.nibbles else BLOCK)

    @property
    def scale_bytes(self) -> int:
        """Bytes of a packed group block's scales (and mins): 8 float16 each."""
        return 2 * GROUP * (1 + self.mins)

    @property
    def group_block_bytes(self) -> int:
        return self.scale_bytes + GROUP * (BLOCK // 2 if self.nibbles else BLOCK)


FORMATS = {
    "q4_0": QuantFormat("q4_0", nibbles=True, mins=False, bias=8),
    "q4_1": QuantFormat("q4_1", nibbles=True, mins=True, bias=0),
    "q8_0": QuantFormat("q8_0", nibbles=False, mins=False, bias=0),
}
FORMAT_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # csrc/quant_blocks.h's Fmt


@dataclass(slots=True)
class QuantizedWeight:
    """An `[n, k]` weight in `fmt`, packed: `data` is uint8 `[ceil(n / 8), k / 32, bytes]`."""

    fmt: QuantFormat
    n: int
    k: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Scales `[groups, nb, 8]`, mins (or None) and values `[groups, nb, 8 rows, 32]`
        (as stored, before the format's bias)."""
        f, data = self.fmt, self.data
        groups, nb = data.shape[:2]
        scales = data[..., : 2 * GROUP].contiguous().view(torch.float16).float()
        mins = None
        if f.mins:
            mins = data[..., 2 * GROUP : f.scale_bytes].contiguous().view(torch.float16).float()
        quants = data[..., f.scale_bytes :]
        if f.nibbles:  # [g, nb, quad s, row, 4]: low nibbles k = 4s + i, high k = 16 + 4s + i
            q = quants.reshape(groups, nb, 4, GROUP, 4)
            lo, hi = (q & 0x0F), (q >> 4)
            values = torch.cat([lo, hi], dim=2).to(torch.int16)
        else:
            values = quants.reshape(groups, nb, 8, GROUP, 4).view(torch.int8).to(torch.int16)
        # [g, nb, quad, row, 4] -> [g, nb, row, 32]
        return scales, mins, values.permute(0, 1, 3, 2, 4).reshape(groups, nb, GROUP, BLOCK)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The `[n, k]` weight in `dtype` (each value computed in float32, exact there)."""
        scales, mins, values = self._fields()
        w = (values - self.fmt.bias).float() * scales.unsqueeze(-1)
        if mins is not None:
            w = w + mins.unsqueeze(-1)
        return w.permute(0, 2, 1, 3).reshape(-1, self.k)[: self.n].to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` of the weight, dequantized (an embedding lookup)."""
        sub = QuantizedWeight(self.fmt, index.numel(), self.k, self.data[index // GROUP])
        scales, mins, values = sub._fields()
        pick = torch.arange(index.numel()), index % GROUP
        w = (values[pick[0], :, pick[1]] - self.fmt.bias).float() * scales[
            pick[0], :, pick[1]
        ].unsqueeze(-1)
        if mins is not None:
            w = w + mins[pick[0], :, pick[1]].unsqueeze(-1)
        return w.reshape(index.numel(), self.k).to(dtype)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format stacked (a fused q/k/v or gate/up weight);
        each part but the last must have a multiple of 8 rows."""
        if len(parts) == 1:
            return parts[0]
        fmt, k = parts[0].fmt, parts[0].k
        assert all(p.fmt == fmt and p.k == k for p in parts)
        assert all(p.n % GROUP == 0 for p in parts[:-1])
        data = torch.cat([p.data for p in parts])
        return QuantizedWeight(fmt, sum(p.n for p in parts), k, data)


def runs(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The rows of `parts` (one product's q/k/v or gate/up, each `[n_i, k]`) as few weights of
    one format each, in row order: consecutive parts in one format are stacked. A GGUF mix
    stores parts of one product in different formats (a Q4_K_M file's v in Q6_K beside q and
    k in Q4_K); each run stays in its own blocks rather than all of them being dequantized."""
    out: list[list[QuantizedWeight]] = []
    for p in parts:
        last = out[-1] if out else None
        if last is not None and last[0].fmt == p.fmt and last[-1].n % GROUP == 0:
            last.append(p)
        else:
            out.append([p])
    return [QuantizedWeight.cat(run) for run in out]


def from_gguf_blocks(fmt: QuantFormat, raw: np.ndarray, k: int) -> QuantizedWeight:
    """Pack a GGUF tensor's bytes, `[n, k / 32 * block bytes]` uint8, row by row as stored."""
    n, nb = raw.shape[0], k // BLOCK
    blocks = np.ascontiguousarray(raw).reshape(n, nb, fmt.gguf_block_bytes)
    pad = -n % GROUP
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, nb, fmt.gguf_block_bytes), np.uint8)])
    groups = blocks.shape[0] // GROUP
    # [g, row, nb, bytes] -> [g, nb, row, bytes]
    grouped = blocks.reshape(groups, GROUP, nb, fmt.gguf_block_bytes).transpose(0, 2, 1, 3)
    heads = 4 if fmt.mins else 2
    scales = grouped[..., :2].reshape(groups, nb, 2 * GROUP)  # row r's float16 at 2r
    parts = [scales]
    if fmt.mins:
        parts.append(grouped[..., 2:4].reshape(groups, nb, 2 * GROUP))
    quants = grouped[..., heads:]  # [g, nb, row, 16 or 32]
    # Quad-major: vector j holds bytes [4j, 4j + 4) of every row, row after row.
    quads = quants.reshape(groups, nb, GROUP, -1, 4).transpose(0, 1, 3, 2, 4)
    parts.append(quads.reshape(groups, nb, -1))
    packed = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return QuantizedWeight(fmt, n, k, torch.from_numpy(packed))


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    """Quantize a float `[n, k]` weight (k a multiple of 32) the way llama.cpp's reference
    quantizers do, straight into the packed layout."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt.name == "q8_0":
        d = w.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(w * inv.unsqueeze(-1)).to(torch.int8).view(torch.uint8)
        fields = [d]
    elif fmt.name == "q4_0":
        # The value of largest magnitude maps to -8, keeping its sign.
        big = torch.gather(w, -1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d = big / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (w * inv.unsqueeze(-1) + 8.5).clamp(0, 15).to(torch.uint8)
        fields = [d]
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((w - lo.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).clamp(0, 15).to(torch.uint8)
        fields = [d, lo]
    head = [f.half().unsqueeze(-1).view(torch.uint8) for f in fields]
    if fmt.nibbles:
        q = q[..., :16] | (q[..., 16:] << 4)
    raw = torch.cat([*head, q], dim=-1).reshape(n, -1)
    return from_gguf_blocks(fmt, raw.numpy(), k)
