"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

Weights arrive as a state dict with Hugging Face names; q/k/v and gate/up projections are
fused at load so each layer runs three large products instead of six small ones.

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

from shoal.layers.attention import AttentionMetadata, paged_attention
from shoal.layers.linear import Linear
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import RotaryEmbedding, rotate
from shoal.models.config import ModelConfig

Weights = dict[str, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w.pop(f"{n}.bias") for n in names])
        self.qkv_proj = Linear(torch.cat([w.pop(f"{n}.weight") for n in names]), bias)
        self.o_proj = Linear(w.pop(f"{prefix}.o_proj.weight"))
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(w.pop(f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(w.pop(f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : heads * self.head_dim].reshape(t, heads, self.head_dim)
        v = qkv[:, heads * self.head_dim :].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = rotate(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, w: Weights, prefix: str) -> None:
        super().__init__()
        gate, up = w.pop(f"{prefix}.gate_proj.weight"), w.pop(f"{prefix}.up_proj.weight")
        self.intermediate = gate.shape[0]
        self.gate_up_proj = Linear(torch.cat([gate, up]))
        self.down_proj = Linear(w.pop(f"{prefix}.down_proj.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        # In place, on the product's own output: two fewer [tokens, intermediate] temporaries.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(w.pop(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = Attention(cfg, w, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(
            w.pop(f"{prefix}.post_attention_layernorm.weight"), eps
        )
        self.mlp = MLP(w, f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int) -> None:
        super().__init__()
        w = dict(weights)
        self.config = cfg
        dtype = w["model.embed_tokens.weight"].dtype
        self.embed_tokens = nn.Parameter(w.pop("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, w, f"model.layers.{i}") for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(w.pop("model.norm.weight"), cfg.rms_norm_eps)
        head = w.pop("lm_head.weight", None)
        if head is None or cfg.tie_word_embeddings:
            head = self.embed_tokens.data
        self.lm_head = Linear(head)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions, dtype)
        self.max_positions = max_positions
        self.act_dtype = dtype
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
        x = F.embedding(input_ids, self.embed_tokens).to(self.act_dtype)
        cos_sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, meta, cos_sin)
        return x

    def use_float32_activations(self) -> None:
        """Keep the projection weights (and the embedding) as they are; run the rest in fp32."""
        self.act_dtype = torch.float32
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.float()
        device = self.embed_tokens.device
        self.rotary = RotaryEmbedding(
            self.config.hf_config, self.config.head_dim, self.max_positions, torch.float32
        ).to(device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
