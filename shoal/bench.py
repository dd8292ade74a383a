"""Workload W1 (issue 2): 64 requests, prompts of 32-512 tokens, 128 tokens out, EOS ignored."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from shoal.sampling_params import SamplingParams


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


def w1_workload(vocab_size: int, num_requests: int = 64, max_tokens: int = 128) -> Workload:
    """Prompt lengths uniform in [32, 512] from `random.Random(0)`; token ids drawn the same way."""
    rng = random.Random(0)
    lengths = [rng.randint(32, 512) for _ in range(num_requests)]
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, max_tokens)


def run_w1(model: str | None = None, dtype: str = "float32", num_requests: int = 64) -> float:
    """Run W1 on shoal and print output tokens per second; returns it."""
    from shoal.engine.llm_engine import Engine
    from shoal.llm import LLM

    llm = LLM(model, dtype=dtype)
    assert isinstance(llm.engine, Engine)  # W1 measures the torch engine
    work = w1_workload(llm.engine.model_config.vocab_size, num_requests)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    rate = generated / elapsed
    print(f"shoal: {generated} output tokens in {elapsed:.1f} s = {rate:.1f} tokens/s")
    return rate
