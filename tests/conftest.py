"""Shared fixtures: tiny random-weight HF model folders, built once per session.

`tiny_model_dir(kind)` returns a folder `LLM(str(path), dtype="float64")` can load. The folders
hold no tokenizer, so prompts are lists of token ids. Weights come from `torch.manual_seed(0)`
and are saved in float64, where ties between logits are practically impossible, so greedy
decoding is deterministic and comparable token for token with transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Live-server fixtures (tests/server/server_fixtures.py), shared by the server and batchify tests.
pytest_plugins = ["server_fixtures"]

# One thread per pool unless the caller says otherwise. The engine runs products through
# NumPy's OpenBLAS and the rest through torch; on a busy 2-core machine their two spinning
# thread pools fight, and a SmolLM2 decode step went from 0.02 s to 3.5 s. Set before torch
# and NumPy are imported (test modules import them after this file).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# Without an NVIDIA GPU, triton (where installed) can only interpret its kernels
# (tests/layers/test_triton_attention.py). `@triton.jit` reads the flag when it decorates, which
# for triton's own library is when triton is first imported, by whichever module: so here.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 320
TINY_MAX_POSITIONS = 512

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": TINY_MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # Wide weights keep the random model from just echoing its input (with the default 0.02
    # a tied model repeats the last prompt token forever, which would test nothing).
    "initializer_range": 0.4,
}

# kind -> (config class name, extra config arguments)
TINY_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
}

# A chat template for the tiny word-level tokenizer: "user w5 w6 assistant".
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def tiny_words() -> list[str]:
    """The tiny tokenizer's vocabulary: ids 0-2 are special, then short distinct words."""
    words = ["<pad>", "<s>", "</s>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(TINY_VOCAB - len(words))]
    return words


def save_tiny_tokenizer(path: Path) -> None:
    """A word-level tokenizer over `tiny_words()` (decodes with spaces), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(tiny_words())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_tiny_model(kind: str, path: Path) -> Path:
    """Save a seeded random float64 model of `kind` (see TINY_KINDS) to `path`."""
    import torch
    import transformers

    class_name, extra = TINY_KINDS[kind]
    config_cls = getattr(transformers, class_name)
    config = config_cls(**{**_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.float64)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model_dir("llama")` -> a cached folder; kinds: see TINY_KINDS.

    `tiny_model_dir("llama", tokenizer=True)` adds a word-level tokenizer (see `tiny_words`)
    with a chat template, so string prompts, stop strings and `chat()` work too.
    """
    cache: dict[tuple[str, bool], Path] = {}

    def get(kind: str = "llama", tokenizer: bool = False) -> Path:
        key = (kind, tokenizer)
        if key not in cache:
            path = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
            if tokenizer:
                save_tiny_tokenizer(path)
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(scope="session")
def bundled_llm() -> Any:
    """The real bundled SmolLM2-135M-Instruct, loaded once per session (about 12 s).

    Tests must leave it idle (every request finished) for the next user.
    """
    from shoal import LLM

    return LLM(kv_cache_bytes=256 << 20)


@pytest.fixture(scope="session")
def tiny_hf_model() -> Callable[[Path], Any]:
    """The transformers reference for a tiny folder, loaded once per folder, in float64."""
    cache: dict[Path, Any] = {}

    def get(path: Path) -> Any:
        if path not in cache:
            import torch
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
            # Compare with ignore_eos=True: generate() runs to max_new_tokens, EOS or not.
            model.generation_config.eos_token_id = None
            cache[path] = model.eval()
        return cache[path]

    return get
