"""The bundled SmolLM2 GGUF through `mx.load` and mlx-lm's llama: batched greedy answers equal
mlx-lm's own single-sequence decoding, and a chat answer is right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_helpers import run
from mlx_lm.generate import generate_step

from shoal.backends.mlx import BlockPoolBatchEngine, ModelCacheSpec, load_gguf
from shoal.backends.mlx.blas import find_openblas
from shoal.engine.block_pool import BlockPool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_gguf()


def test_three_chat_agents_match_mlx_lm_generate(smollm2: Any) -> None:
    spec = ModelCacheSpec.from_model(smollm2.model, smollm2.fingerprint)
    assert (spec.num_layers, spec.kv_heads, spec.head_dim, spec.dtype) == (30, 3, 64, "float32")
    engine = BlockPoolBatchEngine(
        smollm2.model,
        smollm2.tokenizer,
        BlockPool(16, spec.block_tokens),
        spec,
        eos_token_ids=smollm2.eos_token_ids,
    )
    questions = {
        "geo": "What is the capital of France?",
        "math": "What is 2 + 2?",
        "color": "Name a color.",
    }
    uids = {}
    for agent, q in questions.items():
        text = smollm2.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        uids[engine.submit(agent, text, max_tokens=8)] = text
    done = run(engine)
    for uid, text in uids.items():
        ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
        want = []
        for t, _ in generate_step(mx.array(ids), smollm2.model, max_tokens=8):
            want.append(int(t))
            if t in smollm2.eos_token_ids:
                break
        assert done[uid].token_ids == want
    assert "Paris" in next(c.text for c in done.values() if c.agent_id == "geo")
    for agent in questions:
        engine.drop_session(agent)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_openblas_choice_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SHOAL_MLX_BLAS", "none")
    assert find_openblas() is None
    monkeypatch.setenv("SHOAL_MLX_BLAS", str(tmp_path / "libopenblas.so.0"))
    assert find_openblas() == tmp_path / "libopenblas.so.0"
