"""What the greedy-vs-transformers tests share: transformers' own greedy continuation (the
reference), engines on the tiny float64 models, and a loop that feeds requests in at given
steps. `conftest.py` beside this file runs each case with and without the C++ kernels, with
and without speculation (`SPECULATIVE_TOKENS`, set per case) and, on CUDA, with and without
decode CUDA graphs (`ENFORCE_EAGER`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from shoal import LLM, SamplingParams
from shoal.config import EngineConfig
from shoal.engine.llm_engine import Engine
from shoal.outputs import RequestOutput

VOCAB_LOW, VOCAB_HIGH = 3, 319  # stay clear of pad/bos/eos (0, 1, 2)

# `SHOAL_TEST_DEVICE=cuda` runs every case on a GPU (torch's attention and sampling paths);
# CI has none, so by default they run on the CPU.
DEVICE = os.environ.get("SHOAL_TEST_DEVICE", "cpu")

_HF_CACHE: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}


SPECULATIVE_TOKENS = 0
# On CUDA, whether decode steps run eagerly or replay CUDA graphs (set per case).
ENFORCE_EAGER = True


def hf_greedy(hf_model: Any, path: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (generated ids only)."""
    key = (path, tuple(prompt), n)
    if key not in _HF_CACHE:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                pad_token_id=0,
            )
        _HF_CACHE[key] = out[0, len(prompt) :].tolist()
        assert len(_HF_CACHE[key]) == n
    return _HF_CACHE[key]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


# The default 4 GiB KV pool takes seconds to zero; the tiny models need a few MiB.
SMALL_KV = 8 << 20


def make_engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("kv_cache_bytes", SMALL_KV)
    kw.setdefault("num_speculative_tokens", SPECULATIVE_TOKENS)
    kw.setdefault("enforce_eager", ENFORCE_EAGER)
    return Engine(EngineConfig(model=str(path), dtype="float64", device=DEVICE, **kw))


def make_llm(path: Path, **kw: Any) -> LLM:
    kw.setdefault("num_speculative_tokens", SPECULATIVE_TOKENS)
    kw.setdefault("enforce_eager", ENFORCE_EAGER)
    return LLM(str(path), dtype="float64", kv_cache_bytes=SMALL_KV, device=DEVICE, **kw)


def run_staggered(
    engine: Engine,
    arrivals: dict[int, list[tuple[str, list[int], int]]],
    max_steps: int = 10_000,
) -> dict[str, RequestOutput]:
    """Add `arrivals[step]` before that step; run until every request has finished."""
    expected = sum(len(v) for v in arrivals.values())
    done: dict[str, RequestOutput] = {}
    step = 0
    while len(done) < expected:
        for rid, prompt, n in arrivals.get(step, []):
            engine.add_request(prompt, greedy(n), request_id=rid)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
        step += 1
        assert step < max_steps, "the engine stopped making progress"
    assert not engine.has_unfinished_requests()
    return done


def assert_pool_whole(engine: Engine) -> None:
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


def check_against_hf(
    hf_model: Any, path: Path, requests: list[tuple[str, list[int], int]], done: dict
) -> None:
    for rid, prompt, n in requests:
        out = done[rid]
        assert out.finish_reason == "length", rid
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf_model, path, prompt, n), rid
