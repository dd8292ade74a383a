"""Fixtures for the MLX backend: a tiny random llama (mlx-lm's own model class) with SmolLM2's
tokenizer, engines whose pool is checked whole after every test, and a tiny llama GGUF file for
what loads models by path (`LLM(..., backend="mlx")`, the server).

The tiny model keeps 2,000-token runs within seconds on mlx-cpu; the bundled SmolLM2 is used
where the real weights matter (`test_smollm2_mlx.py`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("mlx_lm") is None:  # found without importing: see the BLAS note
    pytest.skip("the MLX backend needs `pip install 'shoal[mlx]'`", allow_module_level=True)

# shoal.backends.mlx first: it may preload OpenBLAS, which must come before mlx.
from shoal.backends.mlx import BlockPoolBatchEngine, ModelCacheSpec

# isort: split
import mlx.core as mx
from mlx.utils import tree_map
from mlx_helpers import EngineFactory, write_tiny_gguf
from mlx_lm.models import llama

from shoal.engine.block_pool import BlockPool
from shoal.models.files import bundled_model_path, gguf_metadata

TINY_VOCAB = 1024  # SmolLM2's first ids: its tokenizer decodes what the tiny model says


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return gguf_metadata(bundled_model_path())[1]


@pytest.fixture(scope="session")
def tiny_model() -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=TINY_VOCAB,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    # mlx-lm's default init makes a model that repeats one token; wider matrices make every
    # step's choice depend on the context, so equal outputs mean equal computations.
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf")


@pytest.fixture
def make_engine(tiny_model: llama.Model, tokenizer: Any) -> Iterator[EngineFactory]:
    """Engines over the tiny model; after the test each must be idle and, once its agents are
    dropped, hold no block and no KV data."""
    engines: list[BlockPoolBatchEngine] = []

    def make(
        num_blocks: int = 64,
        block_tokens: int = 16,
        cache_dir: Path | None = None,
        model: Any = None,
        eos_token_ids: list[int] | None = None,
    ) -> BlockPoolBatchEngine:
        model = model or tiny_model
        spec = ModelCacheSpec.from_model(model, "tiny", block_tokens)
        engine = BlockPoolBatchEngine(
            model,
            tokenizer,
            BlockPool(num_blocks, block_tokens),
            spec,
            eos_token_ids=[] if eos_token_ids is None else eos_token_ids,
            cache_dir=cache_dir,
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert not engine.has_work
        held = sum(len(s.block_ids) for s in engine.sessions)
        assert engine.pool.num_used == held
        for s in list(engine.sessions):
            engine.drop_session(s.session_id)
        assert engine.pool.num_free == engine.pool.num_blocks
        # Free blocks keep their data while cached; once the pool forgets them, nothing is held.
        assert engine.data.num_blocks == sum(b.hash is not None for b in engine.pool.blocks)
        engine.pool.evict_cached()
        engine.data.sweep(engine.pool)
        assert engine.data.num_blocks == 0
