"""The MLX backend: design input 001's EXP-006 and the block pool's cost over bare mlx-lm, one run.

EXP-006: reconstruct an agent's cache from 32 blocks x 48 layers (SmolLM2's KV geometry: 3 KV
heads x 64 dims, float32, 256-token blocks, so 8,192 tokens, 604 MB) and report p50/p95 over
100 runs. The usual case is blocks of one finished turn (one slab: views, no copy); the worst
is every block from a different slab (a full concatenation), reported beside it.

Throughput: the bundled SmolLM2 through `BlockPoolBatchEngine`, through `MLXEngine` (what
`LLM(backend="mlx")` and `shoal serve --backend mlx` run: the block engine plus per-token
snapshots and incremental detokenization) and through a bare mlx-lm `BatchGenerator`, the same
prompts (16 agents, prompt lengths 32-256, 64 tokens each with EOS ignored), greedy; prints
output tokens/s of each and the ratios to bare (the seed asks for >= 0.8).

    .venv/bin/python benchmarks/mlx_block_pool.py [--agents 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

# shoal.backends.mlx first: it may preload OpenBLAS, which must come before mlx.
from shoal.backends.mlx import BLAS, BlockPoolBatchEngine, ModelCacheSpec, load_gguf
from shoal.backends.mlx.adapter import MLXEngine
from shoal.backends.mlx.kv import BlockData

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from shoal.config import EngineConfig
from shoal.engine.block_pool import BlockPool
from shoal.sampling_params import SamplingParams


def exp006(runs: int = 100) -> None:
    spec = ModelCacheSpec(48, 3, 64, "float32", "exp-006")
    data = BlockData(spec, None)
    blocks, tokens = 32, 32 * spec.block_tokens
    layers = [
        (mx.random.normal((1, 3, tokens, 64)), mx.random.normal((1, 3, tokens, 64)))
        for _ in range(spec.num_layers)
    ]
    mx.eval(layers)
    ids = list(range(blocks))
    for name, scattered in (("one slab (a finished turn)", False), ("32 slabs (worst)", True)):
        if scattered:
            for b in ids:
                part = [
                    (k[:, :, b * 256 : (b + 1) * 256], v[:, :, b * 256 : (b + 1) * 256])
                    for k, v in layers
                ]
                data.put([b], [(mx.array(k), mx.array(v)) for k, v in part], 256)
        else:
            data.put(ids, layers, tokens)
        times = []
        for _ in range(runs if not scattered else 10):
            start = time.perf_counter()
            out = data.gather(ids, tokens)
            mx.eval(out)
            times.append(time.perf_counter() - start)
        times.sort()
        p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
        print(
            f"EXP-006 reconstruct 32 blocks x 48 layers, {name}: "
            f"p50 {statistics.median(times) * 1e3:.3f} ms, p95 {p95 * 1e3:.3f} ms "
            f"({len(times)} runs)"
        )


def throughput(agents: int, max_tokens: int) -> None:
    loaded = load_gguf()
    rng = random.Random(0)
    vocab = loaded.model.model.embed_tokens.weight.shape[0]
    prompts = [
        [rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))] for _ in range(agents)
    ]

    gen = BatchGenerator(loaded.model, stop_tokens=None)
    start = time.perf_counter()
    gen.insert(prompts, max_tokens=[max_tokens] * agents)
    bare_tokens, finished = 0, 0
    bare_out: dict[int, list[int]] = {}
    while finished < agents:
        for r in gen.next_generated():
            bare_out.setdefault(r.uid, []).append(r.token)
            bare_tokens += 1
            finished += r.finish_reason is not None
    bare = bare_tokens / (time.perf_counter() - start)
    gen.close()

    spec = ModelCacheSpec.from_model(loaded.model, loaded.fingerprint)
    pool = BlockPool(agents * 2, spec.block_tokens)
    engine = BlockPoolBatchEngine(loaded.model, loaded.tokenizer, pool, spec, eos_token_ids=[])
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(f"agent-{i}", p, max_tokens=max_tokens)
    shoal_out: dict[int, list[int]] = {}
    while engine.has_work:
        for c in engine.step():
            shoal_out[c.uid] = c.token_ids
    wrapped = sum(len(t) for t in shoal_out.values()) / (time.perf_counter() - start)
    same = [shoal_out[i] for i in range(agents)] == [bare_out[i] for i in range(agents)]
    print(
        f"throughput, {agents} agents x {max_tokens} tokens: BlockPoolBatchEngine "
        f"{wrapped:.1f} tok/s, bare BatchGenerator {bare:.1f} tok/s, ratio {wrapped / bare:.2f} "
        f"(same tokens: {same})"
    )

    config = EngineConfig(backend="mlx", block_size=spec.block_tokens, num_blocks=agents * 2)
    adapter = MLXEngine(config, model=loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [adapter.add_request(p, params) for p in prompts]
    final = {}
    while adapter.has_unfinished_requests():
        final.update({o.request_id: o.token_ids for o in adapter.step() if o.finished})
    served = sum(len(t) for t in final.values()) / (time.perf_counter() - start)
    same = [final[i] for i in ids] == [bare_out[i] for i in range(agents)]
    print(
        f"throughput, same prompts: MLXEngine {served:.1f} tok/s, ratio to bare "
        f"{served / bare:.2f} (same tokens: {same})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print(f"BLAS preloaded: {BLAS or 'none (mlx-cpu reference BLAS)'}")
    exp006()
    throughput(args.agents, args.max_tokens)


if __name__ == "__main__":
    main()
