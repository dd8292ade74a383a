"""What constrained decoding costs: W1 with half its rows constrained to a JSON schema against
W1 unconstrained, one process run on the bundled SmolLM2-135M (float32, CPU).

W1 is 64 requests, prompts of 32-512 tokens (random.Random(0)), 128 tokens out, EOS ignored,
greedy. In the constrained run every other request must write a JSON array of at least 200
records, which it cannot finish in 128 tokens, so both runs generate exactly 64 x 128 tokens
and their wall times compare the same work; four record schemas over the 32 constrained rows
give the grammar cache its hits. Each run is repeated (alternating, best of `--repeats`) since
the machine may be shared; prefix caching is off, so every repeat does all of W1's prefill
again instead of reusing the first run's. The time spent filling and applying masks
(`Grammars.mask`) and advancing matchers is measured apart. Compiles happen in `add_request`,
inside the timed run.

    .venv/bin/python benchmarks/structured_overhead.py [--num-requests 64] [--max-tokens 128]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal import LLM, SamplingParams
from shoal.bench import cpu_info, w1_workload
from shoal.engine.structured import Grammars, GrammarState
from shoal.sampling_params import StructuredOutput


def record(extra: dict[str, Any]) -> dict[str, Any]:
    props = {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        **extra,
    }
    return {"type": "object", "properties": props, "required": list(props)}


SCHEMAS = [
    {"type": "array", "minItems": 200, "items": record(extra)}
    for extra in (
        {"active": {"type": "boolean"}},
        {"role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"}},
        {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        {"address": record({"city": {"type": "string"}, "zip": {"type": "string"}})},
    )
]


class Timer:
    """Wall time spent in the patched calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(enable_prefix_caching=False)  # every repeat prefills its prompts again
    work = w1_workload(llm.engine.model_config.vocab_size, args.num_requests, args.max_tokens)
    plain = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    mixed = [
        SamplingParams(
            max_tokens=work.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            structured=StructuredOutput(json=SCHEMAS[(i // 2) % len(SCHEMAS)]),
        )
        if i % 2
        else plain
        for i in range(len(work.prompts))
    ]
    timer = Timer()
    Grammars.mask = timer.wrap(Grammars.mask)  # type: ignore[method-assign]
    GrammarState.accept = timer.wrap(GrammarState.accept)  # type: ignore[method-assign]

    run(llm, work.prompts[:4], [plain] * 4)  # warm up the kernels and allocator
    times: dict[str, list[float]] = {"unconstrained": [], "half constrained": []}
    tokens: dict[str, int] = {}
    grammar_s: list[float] = []
    for _ in range(args.repeats):
        for name, params in (
            ("unconstrained", [plain] * len(work.prompts)),
            ("half constrained", mixed),
        ):
            before = timer.seconds
            elapsed, tokens[name] = run(llm, work.prompts, params)
            times[name].append(elapsed)
            if name == "half constrained":
                grammar_s.append(timer.seconds - before)
            print(f"  {name}: {elapsed:.1f} s, {tokens[name]} tokens", flush=True)

    best = {name: min(t) for name, t in times.items()}
    stats = llm.engine.stats()
    lookups = stats.grammar_cache_hits + stats.grammar_cache_misses
    print(f"\nW1, {len(work.prompts)} requests x {work.max_tokens} tokens out, float32")
    print(f"CPU: {cpu_info().describe()}; torch threads {torch.get_num_threads()}")
    for name, t in best.items():
        print(f"{name:<17} {t:7.2f} s (best of {args.repeats})  {tokens[name] / t:7.1f} tokens/s")
    ratio = best["half constrained"] / best["unconstrained"]
    print(f"ratio half constrained / unconstrained: {ratio:.3f} ({100 * (ratio - 1):+.1f} %)")
    print(
        f"grammar work (masks and matchers) in the constrained run: {min(grammar_s):.2f} s "
        f"({100 * min(grammar_s) / best['half constrained']:.1f} % of it)"
    )
    print(
        f"grammar cache: {stats.grammar_cache_hits} hits / {lookups} lookups "
        f"({100 * stats.grammar_cache_hits / max(1, lookups):.1f} % hit rate, "
        f"{stats.grammar_cache_misses} compiles)"
    )


if __name__ == "__main__":
    main()
