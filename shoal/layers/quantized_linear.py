"""Projections whose weights stay in their quantized blocks (GGUF Q4_0/Q4_1/Q8_0, or an HF
model quantized to Q8_0 at load), and the choice between those and float `Linear`s.

On the CPU a product quantizes its float32 rows to int8 blocks and multiplies them with the
blocks in C++ (`quant_kernels`): at batch 1 it reads a quarter (Q4) to a half (Q8_0) of
bfloat16's bytes, the limit of a decode step. Large products (prefill) of the default
precision run the float32 kernel over the weight dequantized a panel at a time instead, except
where AMX or 512-bit VNNI makes the integer products faster. Where
the kernels cannot be built (or for other activation dtypes) the weight is dequantized for the
call, slow but exact to its blocks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers import cpu_kernels, quant_kernels
from shoal.layers.linear import GateUpProjection, Linear
from shoal.layers.quant_formats import QuantizedWeight, runs

Weight = torch.Tensor | QuantizedWeight


# `quantized_activations` -> int8 levels per activation value (`csrc/qtile.h`).
ACTIVATIONS = {"int16": 2, "int8": 1}
# From this many rows (prefill), two-level products run as float32 products over the weight
# dequantized a panel at a time: as fast as float32 weights from 32 rows on a Zen 3 core, where
# two levels ran at 0.6-0.9x of it (`benchmarks/small_batch.py` measures the whole model).
# Not where the integer products are faster (`CpuKernels.integer_prefill`: AMX-INT8, or
# AVX-512 VNNI's 512-bit tiles).
DEQUANTIZED_ROWS = 32


class QuantizedLinear(nn.Module):
    """`levels`: float32 rows are quantized in blocks of 32 to one int8 level per value
    (llama.cpp's activations: faster where products are compute-bound, at large batches, and
    about 1% off on models with outlier features) or two (the default: the rounding residual
    too, about int16's precision, products within ~4e-5 of float). See `csrc/qtile.h`.

    The weight is one or more `runs` of rows, each in one format (`quant_formats.runs`): the
    rows are quantized once and each run writes its columns of the output."""

    def __init__(self, weights: list[QuantizedWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.runs = weights
        self.k, self.n = weights[0].k, sum(w.n for w in weights)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.levels = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.native() if x.device.type == "cpu" else None
        if kernels is None or x.dtype != torch.float32:
            weight = torch.cat([w.dequantize(x.dtype) for w in self.runs]).to(x.device)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, self.k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        biases: list[torch.Tensor | None] = [None] * len(self.runs)
        if self.bias is not None:
            biases = list(self.bias.split([w.n for w in self.runs]))
        if (
            self.levels == 2
            and rows.shape[0] >= DEQUANTIZED_ROWS
            and kernels.has_gemm(x.dtype)
            and not kernels.integer_prefill
        ):
            product = functools.partial(quant_kernels.dequantizing_gemm, kernels, rows)
        else:
            q, blocks = quant_kernels.quantize_rows(kernels, rows, self.levels)
            product = functools.partial(quant_kernels.qgemm, kernels, q, blocks)
        outs = [product(w, b) for w, b in zip(self.runs, biases, strict=True)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.view(*x.shape[:-1], self.n)


class QuantizedGateUp(QuantizedLinear):
    """A gated MLP's `[gate; up]` product, returning silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = super().forward(x)
        kernels = cpu_kernels.for_tensor(gate_up)
        if kernels is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def projection(
    parts: list[Weight], dtype: torch.dtype, bias: torch.Tensor | None = None, gate_up: bool = False
) -> nn.Module:
    """One product over the rows of `parts` (q/k/v, gate/up, or a single weight): quantized
    where every part is quantized (in runs of one format), else float in `dtype` (a quantized
    part beside a float one is dequantized)."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(quantized) == len(parts):
        cls = QuantizedGateUp if gate_up else QuantizedLinear
        return cls(runs(quantized), bias)
    floats = [p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts]
    weight = torch.cat(floats) if len(floats) > 1 else floats[0]
    return GateUpProjection(weight, bias) if gate_up else Linear(weight, bias)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of a model's weights by storage format ("q4_1", "float32", ...): its
    parameters, the packed copies float products made of them, and every quantized weight,
    each counted once (a tied head shares its embedding's bytes)."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(fmt: str, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out[fmt] = out.get(fmt, 0) + t.untyped_storage().nbytes()

    for p in model.parameters():
        add(str(p.dtype).removeprefix("torch."), p)
    for m in model.modules():
        if isinstance(m, Linear) and m._packed is not None:  # the kernel's copy, beside it
            add(str(m._packed[0].dtype).removeprefix("torch."), m._packed[0])
        for value in vars(m).values():
            for w in value if isinstance(value, list) else [value]:
                if isinstance(w, QuantizedWeight):
                    add(w.fmt.name, w.data)
    return out
