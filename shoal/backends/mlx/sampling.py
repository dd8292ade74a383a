"""`SamplingParams` as mlx-lm samplers, and a step's tokens as the output processor's `Sampled`.

The filters are mlx-lm's own (`apply_top_k`, `apply_min_p`, `apply_top_p`), applied in the
torch engine's order to temperature-scaled logits, so a parameter means the same on both
backends. A seeded request draws from its own MLX key (`Sequence.generator`, split once per
token), so its output does not depend on what else shares the batch; an unseeded one draws
from MLX's global generator. Greedy requests get no sampler: `BatchGenerator` then takes one
batched argmax for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from shoal.engine.output_processor import Sampled
from shoal.engine.sequence import Sequence

Sampler = Callable[[mx.array], mx.array]


def seed_key(seed: int) -> mx.array:
    """A request's MLX key. `mx.random.key` takes unsigned 64-bit seeds; callers may pass any
    int a torch generator takes (the API allows negative ones), so seeds are taken mod 2**64."""
    return mx.random.key(seed % (1 << 64))


def make_sampler(seq: Sequence) -> Sampler | None:
    """The sampler for `seq`'s parameters; None for greedy (the generator's shared one)."""
    p = seq.params
    if p.greedy:
        return None
    key: mx.array | None = seq.generator

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        x = logprobs * (1.0 / p.temperature)
        if 0 < p.top_k < x.shape[-1]:
            x = apply_top_k(x, p.top_k)
        if p.min_p > 0:
            x = apply_min_p(x, p.min_p)
        if p.top_p < 1.0:
            x = apply_top_p(x, p.top_p)
        if key is None:
            return mx.random.categorical(x)
        key, draw = mx.random.split(key)
        return mx.random.categorical(x, key=draw)

    return sample


def sampled(tokens: list[int], logprobs: list[mx.array], seqs: list[Sequence]) -> Sampled:
    """The step's tokens, with log-probabilities (of the model's distribution, before
    temperature, as on the torch backend) only when some request asked for them."""
    if all(s.params.logprobs is None for s in seqs):
        return Sampled(tokens, None, None)
    chosen: list[float] = []
    top: list[dict[int, float]] = []
    for token, lp, seq in zip(tokens, logprobs, seqs, strict=True):
        chosen.append(cast(float, lp[token].item()))
        k = seq.params.logprobs or 0
        if not k:
            top.append({})
            continue
        ids = mx.argpartition(-lp, k - 1)[:k]
        values = cast(list[float], lp[ids].tolist())
        pairs = zip(cast(list[int], ids.tolist()), values, strict=True)
        top.append(dict(sorted(pairs, key=lambda kv: -kv[1])))
    return Sampled(tokens, chosen, top)
