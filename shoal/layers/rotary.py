"""Rotary position embeddings (rotate-half layout), with the scaled variants of transformers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings, whether the config speaks transformers 4 or 5."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    if params["rope_type"] == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables `[max_positions, head_dim]`, indexed by absolute position.

    The tables are float32 (float64 for a float64 model), as transformers computes them; the
    C++ kernel reads them as they are and the torch path casts the rows it gathers, which is
    what transformers does before it rotates."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        table = torch.float64 if dtype == torch.float64 else torch.float32
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (emb.cos() * scaling).to(table), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(table), persistent=False)


class Rope:
    """One step's positions, with their cos/sin rows gathered once for every layer, on first
    use (the C++ path indexes the tables itself and never asks)."""

    def __init__(self, table: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.table, self.positions = table, positions
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` of the positions, `[tokens, 1, head_dim]` to broadcast over heads."""
        if self._rows is None or self._rows[0].dtype != dtype:
            cos, sin = self.table.cos, self.table.sin
            self._rows = (
                cos[self.positions].to(dtype).unsqueeze(1),
                sin[self.positions].to(dtype).unsqueeze(1),
            )
        return self._rows


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate `x` ([tokens, heads, head_dim]); pass q and k heads together to halve the ops."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
