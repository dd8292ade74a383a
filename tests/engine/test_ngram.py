"""Prompt lookup: what `NgramProposer` drafts, checked against a plain scan of the tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shoal.engine.ngram import NgramProposer
from shoal.engine.sequence import Sequence
from shoal.sampling_params import SamplingParams


def seq_of(tokens: list[int], split: int | None = None) -> Sequence:
    """A sequence whose first `split` tokens are the prompt and the rest its output."""
    split = len(tokens) if split is None else split
    seq = Sequence("r", tokens[:split], SamplingParams(temperature=0))
    seq.output_token_ids = tokens[split:]
    return seq


def scan(tokens: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """The reference: for the longest n first, what followed the latest earlier occurrence of
    the last n tokens."""
    end = len(tokens)
    for n in range(lookup_max, lookup_min - 1, -1):
        if end <= n:
            continue
        tail = tokens[end - n :]
        for i in range(end - n - 1, -1, -1):
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


def test_drafts_what_followed_the_latest_occurrence():
    proposer = NgramProposer(4, lookup_max=2, lookup_min=1)
    # "7 8" occurred twice: the later one (followed by 1 2) wins.
    assert proposer.propose(seq_of([7, 8, 9, 9, 7, 8, 1, 2, 5, 7, 8]), 10) == [1, 2, 5, 7]


def test_longer_matches_come_first_and_limits_cap_the_draft():
    proposer = NgramProposer(3, lookup_max=3, lookup_min=1)
    tokens = [4, 5, 6, 11, 12, 9, 5, 6, 21, 22, 4, 5, 6]
    # "4 5 6" (n = 3) beats the later "5 6" (n = 2)
    assert proposer.propose(seq_of(tokens), 10) == [11, 12, 9]
    assert proposer.propose(seq_of(tokens), 1) == [11]
    assert proposer.propose(seq_of(tokens), 0) == []


def test_no_match_drafts_nothing():
    proposer = NgramProposer(4, lookup_max=3, lookup_min=2)
    assert proposer.propose(seq_of([1, 2, 3, 4, 5]), 10) == []
    assert proposer.propose(seq_of([1]), 10) == []


def test_a_draft_may_end_at_the_last_token():
    proposer = NgramProposer(5, lookup_max=1, lookup_min=1)
    assert proposer.propose(seq_of([3, 1, 3]), 10) == [1, 3]


@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.lists(st.integers(1, 6), min_size=1, max_size=6),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_the_index_grows_with_the_sequence_and_agrees_with_a_scan(
    tokens: list[int], growth: list[int], k: int, lookup_max: int, below: int
) -> None:
    lookup_min = max(1, lookup_max - below)
    proposer = NgramProposer(k, lookup_max, lookup_min)
    end = max(1, len(tokens) // 2)
    seq = seq_of(tokens[:end], split=max(1, end // 2))
    for step in growth:  # tokens arrive a few at a time, as a request's output does
        assert proposer.propose(seq, k) == scan(seq.token_ids(), k, lookup_max, lookup_min)
        seq.output_token_ids += tokens[end : end + step]
        end += step
    assert proposer.propose(seq, k) == scan(seq.token_ids(), k, lookup_max, lookup_min)
