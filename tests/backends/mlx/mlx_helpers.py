"""Helpers for the MLX backend tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.backends.mlx import BlockPoolBatchEngine

# isort: split
import mlx.core as mx

from shoal.models.files import bundled_model_path

EngineFactory = Callable[..., BlockPoolBatchEngine]


def run(engine: BlockPoolBatchEngine, max_steps: int = 10_000) -> dict[int, Any]:
    """Step until idle; completions by uid."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return done
        for c in engine.step():
            done[c.uid] = c
    raise AssertionError("the engine did not go idle")


def write_tiny_gguf(path: Path, vocab: int = 1024) -> Path:
    """A random 2-layer llama as a GGUF file the MLX loader (and `shoal serve`) can open.

    The tokenizer is SmolLM2's, cut to its first `vocab` ids (its special tokens and chat
    template included) with the merges that stay inside them, so transformers converts it in
    a blink; weights are seeded float32.
    """
    _, meta = mx.load(str(bundled_model_path()), return_metadata=True)
    tokens = meta["tokenizer.ggml.tokens"][:vocab]
    known = set(tokens)
    merges = [
        m
        for m in meta["tokenizer.ggml.merges"]
        if m.replace(" ", "") in known and all(part in known for part in m.split(" "))
    ]
    hidden, layers, ffn, heads, kv_heads = 64, 2, 128, 4, 2

    def u32(x: int) -> mx.array:
        return mx.array(x, dtype=mx.uint32)

    header = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    header |= {
        "general.architecture": "llama",
        "general.name": "tiny-llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:vocab],
        "llama.embedding_length": u32(hidden),
        "llama.block_count": u32(layers),
        "llama.feed_forward_length": u32(ffn),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv_heads),
        "llama.context_length": u32(2048),
        "llama.vocab_size": u32(vocab),
        "llama.rope.dimension_count": u32(hidden // heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
    }
    key = mx.random.key(0)

    def normal(*shape: int) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        return 0.3 * mx.random.normal(shape, key=draw)  # wide: outputs depend on the context

    kv_dim = kv_heads * hidden // heads
    weights = {"token_embd.weight": normal(vocab, hidden), "output_norm.weight": mx.ones(hidden)}
    for i in range(layers):
        shapes = {
            "attn_q": (hidden, hidden),
            "attn_k": (kv_dim, hidden),
            "attn_v": (kv_dim, hidden),
            "attn_output": (hidden, hidden),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
        }
        weights |= {f"blk.{i}.{name}.weight": normal(*s) for name, s in shapes.items()}
        weights |= {f"blk.{i}.{n}.weight": mx.ones(hidden) for n in ("attn_norm", "ffn_norm")}
    mx.save_gguf(str(path), weights, header)
    return path
