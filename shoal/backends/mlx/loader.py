"""A GGUF file as an mlx-lm llama model: `mx.load` reads it (Q4_0, Q4_1 and Q8_0 arrive as
MLX affine-quantized weights), mlx-lm's `llama.Model` runs it, and the tokenizer and chat
template come from `shoal.models.files`, as for the torch engine.

llama.cpp stores Q and K rows interleaved for its rotary layout; instead of undoing that in
every quantized row, the model uses MLX's traditional (interleaved) rope, which is the same
attention. K in the cache is therefore laid out differently from the torch engine's, so the
fingerprint of the KV (`MLXModel.fingerprint`) names the backend and session files never cross.

On a CPU the weights are dequantized to float32 at load: MLX's CPU quantized matmul is a plain
loop, while float32 goes through BLAS (see `blas.py`). On a Metal GPU they stay quantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from shoal.errors import InvalidRequestError
from shoal.models.files import bundled_model_path, gguf_metadata

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(slots=True)
class MLXModel:
    name: str
    model: llama.Model
    tokenizer: Any  # a transformers tokenizer
    eos_token_ids: list[int]
    fingerprint: str  # identity of the model *and* of this backend's KV layout
    dtype: str
    max_model_len: int


def load_gguf(path: str | Path | None = None, quantized: bool | None = None) -> MLXModel:
    """Load a llama-architecture GGUF (the bundled SmolLM2 when `path` is None).

    `quantized=None` keeps the file's quantized weights on a Metal GPU and dequantizes them to
    float32 on a CPU.
    """
    path = bundled_model_path() if path is None else Path(path).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise InvalidRequestError(f"{str(path)!r} is not a .gguf file")
    weights, meta = cast(
        tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(path), return_metadata=True)
    )
    arch = _meta(meta, "general.architecture")
    if arch != "llama":
        raise InvalidRequestError(f"the MLX backend runs llama GGUFs, not {arch!r}")
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=_meta(meta, "llama.embedding_length"),
        num_hidden_layers=_meta(meta, "llama.block_count"),
        intermediate_size=_meta(meta, "llama.feed_forward_length"),
        num_attention_heads=_meta(meta, "llama.attention.head_count"),
        num_key_value_heads=_meta(meta, "llama.attention.head_count_kv"),
        rms_norm_eps=_meta(meta, "llama.attention.layer_norm_rms_epsilon"),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=_meta(meta, "llama.rope.freq_base", 10000.0),
        rope_traditional=True,  # GGUF's interleaved Q/K rows (see the module docstring)
        tie_word_embeddings="output.weight" not in weights,
    )
    named = {_hf_name(k): v for k, v in weights.items()}
    model = llama.Model(args)
    nn.quantize(model, class_predicate=lambda p, m: _quant_params(named, p, m))
    model.load_weights(list(named.items()), strict=True)
    if not (mx.metal.is_available() if quantized is None else quantized):
        plain = llama.Model(args)
        plain.load_weights(_dequantized(model), strict=True)
        model = plain
    mx.eval(model.parameters())
    model.eval()

    hf_config, tokenizer, fingerprint = gguf_metadata(path)
    eos = {int(_meta(meta, "tokenizer.ggml.eos_token_id"))}
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    config_eos = getattr(hf_config, "eos_token_id", None)
    eos.update([config_eos] if isinstance(config_eos, int) else config_eos or [])
    dtype = str(model.model.norm.weight.dtype).removeprefix("mlx.core.")
    context = int(_meta(meta, "llama.context_length", 2048))
    return MLXModel(path.stem, model, tokenizer, sorted(eos), f"{fingerprint}+mlx", dtype, context)


def _meta(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise InvalidRequestError(f"GGUF file lacks {key}")
        return default
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _hf_name(gguf_name: str) -> str:
    base, leaf = gguf_name.rsplit(".", 1)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    try:
        mapped = f"model.layers.{m[1]}.{_BLOCK[m[2]]}" if m else _TOP[base]
    except KeyError as e:
        raise InvalidRequestError(f"unexpected GGUF tensor {gguf_name}") from e
    return f"{mapped}.{leaf}"


def _quant_params(named: dict[str, mx.array], path: str, module: nn.Module) -> bool | dict:
    """How `mx.load` quantized this layer's weight (group size and bits differ per tensor)."""
    scales = named.get(f"{path}.scales")
    if scales is None:
        return False
    in_features = module.weight.shape[-1]
    packed = named[f"{path}.weight"].shape[-1]
    return {"group_size": in_features // scales.shape[-1], "bits": packed * 32 // in_features}


def _dequantized(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The model's parameters with every quantized weight expanded to float32."""
    out = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            w = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits
            )
            out.append((f"{path}.weight", w.astype(mx.float32)))
    quantized = {name.rsplit(".", 1)[0] for name, _ in out}
    for name, value in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())):
        if name.rsplit(".", 1)[0] not in quantized:
            out.append((name, value.astype(mx.float32)))
    return out
