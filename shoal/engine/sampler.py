"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
and grammar masks for constrained requests."""

from __future__ import annotations

import torch

from shoal.engine.output_processor import Sampled
from shoal.engine.sequence import Sequence
from shoal.layers import cpu_kernels


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _constrain(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask, in place, what each constrained row's grammar forbids; other rows are untouched."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if rows:
        states = [seqs[i].grammar for i in rows]
        states[0].grammars.mask(logits, states, rows)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the C++ kernel on the CPU (torch's took 3.3 ms for 64 rows of
    SmolLM2's 49,152 logits, longer than the LM head; the kernel ~0.2 ms), torch elsewhere."""
    kernels = cpu_kernels.native() if logits.device.type == "cpu" else None
    tokens = None if kernels is None else kernels.argmax(logits)
    return logits.argmax(dim=-1) if tokens is None else tokens


def verify_drafts(logits: torch.Tensor, seqs: list[Sequence], sampled: Sampled) -> None:
    """Greedy verification of each sequence's drafts, added to `sampled`: `logits` holds, per
    sequence, a row after its last token and after each draft. Drafts are kept up to the first
    the model's argmax disagrees with; that argmax (or the one after the last draft) follows."""
    choices = _argmax(logits).tolist()
    row = 0
    accepted: list[list[int]] = [[] for _ in sampled.token_ids]  # the sampled rows drafted none
    for seq in seqs:
        drafts = seq.draft_token_ids
        chosen = choices[row : row + len(drafts) + 1]
        row += len(drafts) + 1
        n = 0
        while n < len(drafts) and drafts[n] == chosen[n]:
            n += 1
        accepted.append(drafts[:n])
        sampled.token_ids.append(chosen[n])
        if sampled.logprobs is not None and sampled.top_logprobs is not None:
            sampled.logprobs.append(0.0)  # not asked for: a drafted request wants none
            sampled.top_logprobs.append({})
    sampled.accepted_drafts = accepted


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
    """One token per row. A seeded request draws from its own generator, so its output does
    not depend on what else shares the batch. Log-probabilities are the model's own, taken
    before grammar masks. `logits` may be in the model's dtype: greedy rows are read as they
    are (an argmax is exact in any dtype), everything else in float32."""
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    if want_logprobs or any(s.grammar is not None for s in seqs):
        logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    _constrain(logits, seqs)
    tokens = _argmax(logits)
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            probs = _filter(logits[i].float(), seq)
            tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    token_ids = tokens.tolist()
    if logprobs is None:
        return Sampled(token_ids, None, None)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    top: list[dict[int, float]] = []
    for i, seq in enumerate(seqs):
        k = seq.params.logprobs or 0
        if k:
            values, ids = torch.topk(logprobs[i], k)
            top.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        else:
            top.append({})
    return Sampled(token_ids, chosen, top)
