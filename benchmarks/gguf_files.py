"""The GGUF files `small_batch.py` runs both engines on: the bundled Q4_1 SmolLM2-135M, its
requantizations, and a random-weight Llama-shaped ~1B model written here (its weights do not
fit in any cache, so a decode step streams them from memory).

Requantized files keep the token embedding (the tied LM head) in Q8_0, as the bundled file
has it, and every other matrix in the named type (`llama-quantize --pure
--token-embedding-type q8_0`); a K-quant mix ("Q4_K_M", what ollama ships) keeps llama.cpp's
mix (Q4_K, and Q6_K for some of the value and down projections). A matrix whose rows are not
whole 256-value super-blocks (SmolLM2's 576) gets llama.cpp's fallback type. Files are written
once into the llama.cpp cache folder.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from shoal.models.files import bundled_model_path

# A Llama-3.2-1B-like shape on SmolLM2's tokenizer: 2048 wide, 16 layers, 32 heads of 64
# with 8 kv heads, 8192-wide MLP, tied embedding; about 1.07 B weights.
RANDOM_1B = {
    "hidden": 2048,
    "layers": 16,
    "heads": 32,
    "kv_heads": 8,
    "intermediate": 8192,
}


def requantized(root: Path, source: Path, qtype: str) -> Path:
    """`source` requantized to `qtype` ("Q4_0", "Q8_0", ...) by this llama.cpp build."""
    out = root / f"{source.stem.split('.')[0]}-{qtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        cmd = [
            str(root / "build" / "bin" / "llama-quantize"),
            "--allow-requantize",
            *(() if qtype.endswith(("_S", "_M", "_L")) else ("--pure",)),
            *("--token-embedding-type", "q8_0"),
            str(source),
            str(tmp),
            qtype,
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        tmp.rename(out)
    return out


def random_llama(root: Path, seed: int = 0) -> Path:
    """A float16 GGUF of random weights in RANDOM_1B's shape, with the bundled tokenizer."""
    out = root / "random-llama-1b-F16.gguf"
    if not out.exists():
        rng = np.random.default_rng(seed)

        def matrix(name: str, rows: int, cols: int) -> Tensor:
            return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

        write_llama(out, RANDOM_1B, matrix, gguf.LlamaFileType.MOSTLY_F16)
    return out


# A matrix as `write_llama` adds it: an array gguf-py writes as is, or raw block bytes
# `[rows, cols / block * block bytes]` with their quantization type.
Tensor = np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]


def write_llama(
    out: Path,
    shape: dict[str, int],
    matrix: Callable[[str, int, int], Tensor],
    file_type: gguf.LlamaFileType,
) -> None:
    """Write a Llama GGUF of `shape` (RANDOM_1B's keys) with the bundled tokenizer, taking each
    weight matrix from `matrix(name, rows, cols)` and every norm as ones."""
    h, inter = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * h // shape["heads"]
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(out.stem)
    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(h // shape["heads"])
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(file_type)
    reader = gguf.GGUFReader(bundled_model_path())
    vocab = 0
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(field.contents())
    writer.add_vocab_size(vocab)

    def add(name: str, rows: int, cols: int) -> None:
        t = matrix(name, rows, cols)
        if isinstance(t, tuple):
            writer.add_tensor(name, t[0], raw_dtype=t[1])  # its shape: the bytes' shape
        else:
            writer.add_tensor(name, t)

    add("token_embd.weight", vocab, h)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(shape["layers"]):
        for name, rows, cols in (
            ("attn_q", h, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, h),
            ("ffn_gate", inter, h),
            ("ffn_up", inter, h),
            ("ffn_down", h, inter),
        ):
            add(f"blk.{i}.{name}.weight", rows, cols)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def files(root: Path, names: list[str]) -> dict[str, Path]:
    """The files named ("smollm2-Q4_1", "smollm2-Q4_0", "random1b-Q8_0", ...), made if needed."""
    out: dict[str, Path] = {}
    for name in names:
        model, qtype = name.rsplit("-", 1)
        if model == "smollm2":
            bundled = bundled_model_path()
            out[name] = bundled if qtype == "Q4_1" else requantized(root, bundled, qtype)
        elif model == "random1b":
            out[name] = requantized(root, random_llama(root), qtype)
        else:
            raise ValueError(f"unknown model {model!r}")
    return out
