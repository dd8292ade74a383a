"""On CUDA, greedy float32 decoding through the Triton attention kernel, with decode steps run
eagerly and replayed as CUDA graphs, equals transformers' float32 greedy decoding on the same
GPU, token for token: staggered arrivals (decode batches of many sizes, so many buckets),
chunked prefill beside decodes, and prefix-cache hits (chunks after cached context).

The float64 cases (test_greedy_vs_transformers, `SHOAL_TEST_DEVICE=cuda`) cover the graphs
on torch's attention path; the Triton kernel takes float16, bfloat16 and float32 only.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_cases import SMALL_KV, assert_pool_whole, random_prompt, run_staggered

from shoal.config import EngineConfig
from shoal.engine.llm_engine import Engine
from shoal.layers import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_HF: dict[Path, Any] = {}


def hf_float32(path: Path) -> Any:
    if path not in _HF:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        model.generation_config.eos_token_id = None
        _HF[path] = model
    return _HF[path]


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf_float32(path).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_float32_on_cuda_matches_transformers(kind, enforce_eager, tiny_model_dir):
    assert attention._triton_module() is not None, "triton does not import here"
    path = tiny_model_dir(kind)
    engine = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cuda",
            block_size=4,
            max_num_batched_tokens=32,
            kv_cache_bytes=SMALL_KV,
            enforce_eager=enforce_eager,
        )
    )
    graphs = engine.runner.graphs
    assert (graphs is None) == enforce_eager
    replays = 0
    if graphs is not None:
        run = graphs.run

        def counted(step):
            nonlocal replays
            replays += 1
            return run(step)

        graphs.run = counted  # type: ignore[method-assign]
    rng = random.Random(21)
    system = random_prompt(rng, 26)
    requests = [
        (f"g{i}", (system if i % 2 else []) + random_prompt(rng, rng.randint(1, 70)), 20)
        for i in range(12)
    ]
    arrivals = {0: requests[:3], 2: requests[3:7], 9: requests[7:]}
    done = run_staggered(engine, arrivals)
    for rid, prompt, n in requests:
        assert done[rid].token_ids == hf_greedy(path, prompt, n), rid
    assert engine.stats().prefix_cache_hit_rate > 0
    assert (replays > 0) == (not enforce_eager)
    assert_pool_whole(engine)
