"""The few facts about a model the engine needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.errors import InvalidRequestError

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    hf_config: Any  # kept for RoPE variants

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelConfig:
        model_type = cfg.model_type
        if model_type not in SUPPORTED:
            raise InvalidRequestError(
                f"model type {model_type!r} is not supported (supported: {sorted(SUPPORTED)})"
            )
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
            raise InvalidRequestError("sliding-window attention is not supported")
        heads = cfg.num_attention_heads
        eos = cfg.eos_token_id
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            hf_config=cfg,
        )

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
