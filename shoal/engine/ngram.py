"""Draft tokens by prompt lookup (n-gram speculation, vLLM's `method="ngram"`).

A greedy request often repeats itself or its prompt: code being edited, a quoted document, a
small model looping. The last few tokens are looked up among earlier ones; what followed their
latest earlier occurrence is proposed as the next tokens, and one step verifies them all (the
model computes every draft position; drafts are kept up to the first that differs from the
model's own greedy choice, plus that choice). Decode steps are bound by reading weights and KV,
so verifying several tokens costs little more than computing one.

Each sequence carries an index from every n-gram it holds (n in `[lookup_min, lookup_max]`) to
the position after its latest occurrence, extended as tokens arrive: a lookup is a dict probe,
not a scan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.sequence import Sequence


@dataclass(slots=True)
class NgramIndex:
    """For each n, n-gram -> the position of the token that followed its latest occurrence."""

    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # positions [0, indexed) are in the tables


class NgramProposer:
    def __init__(self, num_tokens: int, lookup_max: int, lookup_min: int) -> None:
        self.num_tokens = num_tokens
        self.sizes = range(lookup_max, lookup_min - 1, -1)  # longest match first

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `min(num_tokens, limit)` tokens to follow `seq`'s, or none without a match."""
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        index = seq.ngram_index
        if index is None:
            index = seq.ngram_index = NgramIndex({n: {} for n in self.sizes})
        end = seq.num_tokens
        for p in range(max(index.indexed, 1), end):  # the n-grams that end just before p
            for n, table in index.tables.items():
                if p >= n:
                    table[tuple(seq.tokens_slice(p - n, p))] = p
        index.indexed = end
        for n in self.sizes:
            if end <= n:
                continue
            after = index.tables[n].get(tuple(seq.tokens_slice(end - n, end)))
            if after is not None:
                return seq.tokens_slice(after, min(after + k, end))
        return []
