"""Loading weights into torch: an HF folder, a single GGUF file, or the bundled SmolLM2.

Where files lie and what a GGUF's config and tokenizer are is `shoal.models.files` (no torch).

`quantization` keeps weights quantized in memory (`layers/quant_formats.py`): "gguf" keeps a
GGUF's Q4_0, Q4_1 and Q8_0 tensors in their blocks, Q4_K and Q6_K repacked into Q4_1 and Q8_0
blocks (`layers/kquants.py`; other types are dequantized to `dtype`);
"int8" quantizes every projection, the LM head and the embedding to Q8_0 blocks (weight-only
int8, a scale per 32 values of each output channel). None dequantizes everything to `dtype`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.errors import InvalidRequestError
from shoal.layers.kquants import KQUANTS
from shoal.layers.quant_formats import BLOCK, FORMATS, QuantizedWeight, from_gguf_blocks, quantize
from shoal.models.config import ModelConfig
from shoal.models.files import bundled_model_path, fingerprint_files, gguf_metadata

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
QUANTIZATIONS = ("gguf", "int8")
Weight = torch.Tensor | QuantizedWeight


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, Weight]
    dtype: torch.dtype  # of the float weights, and the KV cache
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only models
    fingerprint: str


def load_model(model: str | None, dtype: str, quantization: str | None = None) -> LoadedModel:
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise InvalidRequestError(f"model path {str(path)!r} does not exist")
    torch_dtype = DTYPES[dtype]
    gguf_file = path.is_file() and path.suffix == ".gguf"
    if quantization == "gguf" and not gguf_file:
        raise InvalidRequestError('quantization="gguf" needs a .gguf file')
    if gguf_file:
        loaded = _load_gguf(path, torch_dtype, keep_blocks=quantization == "gguf")
    elif path.is_dir() and (path / "config.json").exists():
        loaded = _load_hf_folder(path, torch_dtype)
    else:
        raise InvalidRequestError(f"{str(path)!r} is neither a .gguf file nor an HF model folder")
    if quantization == "int8":
        loaded.weights = quantize_int8(loaded.weights)
    if quantization is not None:  # other weights, other KV: no prefix or session sharing
        loaded.fingerprint = f"{loaded.fingerprint}:{quantization}"
    return loaded


def quantize_int8(weights: dict[str, Weight]) -> dict[str, Weight]:
    """Projections, LM head and embedding as Q8_0 blocks (those whose rows are whole blocks)."""
    out = dict(weights)
    for name, w in weights.items():
        matrix = name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))
        if matrix and isinstance(w, torch.Tensor) and w.shape[1] % BLOCK == 0:
            out[name] = quantize(w, FORMATS["q8_0"])
    return out


def _load_hf_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidRequestError(f"no .safetensors weights in {str(path)!r}")
    weights: dict[str, Weight] = {}
    for f in files:
        weights.update({k: v.to(dtype) for k, v in load_file(f).items()})
    cfg = ModelConfig.from_hf(hf_config)
    gen_config = path / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = sorted(
                {*cfg.eos_token_ids, *([eos] if isinstance(eos, int) else eos)}
            )
    tokenizer = None
    if any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    fp = fingerprint_files((path / "config.json").read_text(), files)
    return LoadedModel(path.name, cfg, weights, dtype, tokenizer, fp)


def _load_gguf(path: Path, dtype: torch.dtype, keep_blocks: bool) -> LoadedModel:
    import gguf

    hf_config, tokenizer, fp = gguf_metadata(path)
    cfg = ModelConfig.from_hf(hf_config)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in cfg.eos_token_ids:
        cfg.eos_token_ids.append(tokenizer.eos_token_id)

    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    name_map = gguf.get_tensor_name_map(arch, cfg.num_layers)
    tensors = {t.name: t for t in reader.tensors}
    weights: dict[str, Weight] = {}
    for hf_name in _expected_hf_names(cfg):
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            if hf_name == "lm_head.weight":
                continue  # tied to the embedding
            raise InvalidRequestError(f"GGUF file lacks tensor {gguf_name} ({hf_name})")
        t = tensors[gguf_name]
        matrix = len(t.shape) == 2
        pack = _packer(t.tensor_type.name.lower()) if keep_blocks and matrix else None
        # Quantized rows are whole blocks: llama.cpp's q/k row order is undone on them as is.
        w = t.data if pack is not None else gguf.dequantize(t.data, t.tensor_type)
        if arch_name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            w = _unpermute_rope(w, heads)
        if pack is not None:
            weights[hf_name] = pack(w, int(t.shape[0]))
        else:
            weights[hf_name] = torch.from_numpy(np.array(w, copy=True)).to(dtype)
    return LoadedModel(path.stem, cfg, weights, dtype, tokenizer, fp)


def _packer(type_name: str) -> Callable[[np.ndarray, int], QuantizedWeight] | None:
    """How a GGUF tensor type stays quantized in memory (None: it is dequantized)."""
    if type_name in FORMATS:
        return functools.partial(from_gguf_blocks, FORMATS[type_name])
    return KQUANTS.get(type_name)


def _expected_hf_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    if cfg.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer]
    return names


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows, back to the rotate-half layout."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
