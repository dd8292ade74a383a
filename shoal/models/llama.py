"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

Weights arrive as a state dict with Hugging Face names; q/k/v and gate/up projections are
fused at load so each layer runs three large products instead of six small ones.

The residual stream is carried beside the layers' outputs, so each residual add is fused into
the RMSNorm that follows it (`RMSNorm.add_forward`, as vLLM does); SiLU × up runs in the
gate-up product's epilogue (`GateUpProjection`), and the rotary embedding with the KV-cache
write is a single C++ pass on the CPU.

On a CPU without native bfloat16 arithmetic, bfloat16 weights run best with float32
activations: the products widen the weight in their kernel (halving its memory traffic, fp32
accumulation), and every other op runs in float32 instead of converting per element
(`use_float32_activations`, as llama.cpp does on AVX2). The KV cache stays bfloat16.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.attention import AttentionMetadata, paged_attention, rope_and_store
from shoal.layers.norm import RMSNorm
from shoal.layers.quant_formats import QuantizedWeight
from shoal.layers.quantized_linear import QuantizedLinear, Weight, projection
from shoal.layers.rotary import Rope, RotaryEmbedding
from shoal.models import fused_decode
from shoal.models.config import ModelConfig
from shoal.models.fused_decode import FusedDecode

Weights = dict[str, Weight]


def _tensor(w: Weight) -> torch.Tensor:
    assert isinstance(w, torch.Tensor), "only projection weights may be quantized"
    return w


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([_tensor(w.pop(f"{n}.bias")) for n in names])
        self.qkv_proj = projection([w.pop(f"{n}.weight") for n in names], dtype, bias)
        self.o_proj = projection([w.pop(f"{prefix}.o_proj.weight")], dtype)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            eps = cfg.rms_norm_eps
            self.q_norm = RMSNorm(_tensor(w.pop(f"{prefix}.q_norm.weight")), eps)
            self.k_norm = RMSNorm(_tensor(w.pop(f"{prefix}.k_norm.weight")), eps)
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: Rope) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: before the rotation
            q, k = (
                qkv[:, : (self.num_heads + self.num_kv_heads) * d]
                .view(t, -1, d)
                .split([self.num_heads, self.num_kv_heads], dim=1)
            )
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        q, k, v = rope_and_store(
            qkv, self.num_heads, self.num_kv_heads, rope, meta, self.k_cache, self.v_cache
        )
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * d))


class MLP(nn.Module):
    def __init__(self, w: Weights, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        gate, up = w.pop(f"{prefix}.gate_proj.weight"), w.pop(f"{prefix}.up_proj.weight")
        self.gate_up_proj = projection([gate, up], dtype, gate_up=True)
        self.down_proj = projection([w.pop(f"{prefix}.down_proj.weight")], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(_tensor(w.pop(f"{prefix}.input_layernorm.weight")), eps)
        self.self_attn = Attention(cfg, w, f"{prefix}.self_attn", dtype)
        self.post_attention_layernorm = RMSNorm(
            _tensor(w.pop(f"{prefix}.post_attention_layernorm.weight")), eps
        )
        self.mlp = MLP(w, f"{prefix}.mlp", dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on `x + residual` (the first layer has no residual yet); returns the
        layer's output and the new residual, whose sum is the layer's hidden state."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, meta, rope)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """`dtype` is the model's: its float weights and KV cache. With quantized weights the
    activations are float32 (`use_float32_activations`), the KV cache stays in `dtype`."""

    def __init__(
        self, cfg: ModelConfig, weights: Weights, max_positions: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        w = dict(weights)
        self.config, self.dtype = cfg, dtype
        embed = w.pop("model.embed_tokens.weight")
        # A quantized embedding is looked up row by row from its blocks.
        self.embed_blocks = embed if isinstance(embed, QuantizedWeight) else None
        self.embed_tokens = None
        if isinstance(embed, torch.Tensor):
            self.embed_tokens = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, w, f"model.layers.{i}", dtype) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(_tensor(w.pop("model.norm.weight")), cfg.rms_norm_eps)
        head = w.pop("lm_head.weight", None)
        if head is None or cfg.tie_word_embeddings:
            head = embed if self.embed_tokens is None else self.embed_tokens.data
        self.lm_head = projection([head], dtype)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions, dtype)
        self.act_dtype = dtype
        self.quantized = any(isinstance(v, QuantizedWeight) for v in weights.values())
        self.fused: FusedDecode | None = None  # set by `use_fused_decode`
        self.activation_levels = 2  # int8 levels per quantized activation
        w = {k: v for k, v in w.items() if "rotary_emb" not in k}
        if w:
            raise ValueError(f"unexpected weights: {sorted(w)[:5]}")

    @property
    def attention_layers(self) -> list[Attention]:
        """Each layer's attention, where the runner hangs that layer's KV cache."""
        return [cast(DecoderLayer, layer).self_attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.fused is not None and not meta.prefills and meta.num_decodes == x.shape[0]:
            self.fused(x, positions, meta)
            return x
        rope = Rope(self.rotary, positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, meta, rope)
        return x if residual is None else x.add_(residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_blocks is not None:
            return self.embed_blocks.rows(input_ids.cpu(), self.act_dtype).to(input_ids.device)
        assert self.embed_tokens is not None
        return F.embedding(input_ids, self.embed_tokens).to(self.act_dtype)

    def use_activation_levels(self, levels: int) -> None:
        """int8 levels per value (1 or 2) quantized products quantize their rows to."""
        self.activation_levels = levels
        for module in self.modules():
            if isinstance(module, QuantizedLinear):
                module.levels = levels

    def use_fused_decode(self) -> bool:
        """Run decode-only steps through one C++ call where this model allows it (once its KV
        caches and activation dtype are set); returns whether it does."""
        self.fused = FusedDecode(self) if fused_decode.supported(self) else None
        return self.fused is not None

    def use_float32_activations(self) -> None:
        """Keep the projection weights (and the embedding) as they are; run the rest in fp32."""
        self.act_dtype = torch.float32
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
