"""Sampling: seeds, top-k/top-p/min-p, log-probabilities, stop tokens and stop strings."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.config import EngineConfig
from shoal.engine.llm_engine import Engine
from shoal.engine.sampler import sample
from shoal.engine.sequence import Sequence
from shoal.outputs import RequestOutput

SMALL_KV = 8 << 20


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(6, 319) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", tokenizer=True)


@pytest.fixture(scope="module")
def llm(tiny_path) -> LLM:
    return LLM(str(tiny_path), dtype="float64", kv_cache_bytes=SMALL_KV)


def run_all(engine: Engine, arrivals: dict[int, list[tuple[str, Any, SamplingParams]]]) -> dict:
    expected = sum(len(v) for v in arrivals.values())
    done: dict[str, RequestOutput] = {}
    step = 0
    while len(done) < expected:
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(prompt, sp, request_id=rid)
        done |= {o.request_id: o for o in engine.step() if o.finished}
        step += 1
        assert step < 5000
    assert engine.pool.num_free == engine.pool.num_blocks
    return done


# -- the sampler on hand-made logits ------------------------------------------------------
def seqs_with(n: int, **params: Any) -> list[Sequence]:
    out = []
    for i in range(n):
        seq = Sequence(f"s{i}", [1], SamplingParams(**params))
        seq.generator = torch.Generator().manual_seed(i)
        out.append(seq)
    return out


def support(logits: list[float], draws: int = 400, **params: Any) -> set[int]:
    seqs = seqs_with(draws, **params)
    rows = torch.tensor([logits] * draws, dtype=torch.float64)
    return set(sample(rows, seqs).token_ids)


PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]  # sorted: 1 (0.4), 3 (0.3), 4 (0.15), 2 (0.1), 0 (0.05)
LOGITS = [float(torch.tensor(p).log()) for p in PROBS]


def test_plain_sampling_reaches_every_token():
    assert support(LOGITS, temperature=1.0) == {0, 1, 2, 3, 4}


def test_top_k_keeps_the_k_most_likely():
    assert support(LOGITS, temperature=1.0, top_k=2) == {1, 3}
    assert support(LOGITS, temperature=1.0, top_k=1) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert support(LOGITS, temperature=1.0, top_p=0.5) == {1, 3}  # 0.4 < 0.5 <= 0.7
    assert support(LOGITS, temperature=1.0, top_p=0.4) == {1}
    assert support(LOGITS, temperature=1.0, top_p=0.8) == {1, 3, 4}


def test_min_p_drops_tokens_far_below_the_best():
    assert support(LOGITS, temperature=1.0, min_p=0.5) == {1, 3}  # >= 0.2
    assert support(LOGITS, temperature=1.0, min_p=0.3) == {1, 3, 4}  # >= 0.12


def test_sampling_follows_the_distribution():
    seqs = seqs_with(4000, temperature=1.0)
    rows = torch.tensor([LOGITS] * len(seqs), dtype=torch.float64)
    counts = torch.bincount(torch.tensor(sample(rows, seqs).token_ids), minlength=5)
    freq = counts.double() / len(seqs)
    assert torch.allclose(freq, torch.tensor(PROBS, dtype=torch.float64), atol=0.03)


def test_low_temperature_sharpens():
    seqs = seqs_with(300, temperature=0.02)  # 0.4 vs 0.3 becomes ~1.8e6 : 1
    rows = torch.tensor([LOGITS] * len(seqs), dtype=torch.float64)
    assert set(sample(rows, seqs).token_ids) == {1}


def test_a_vanishing_temperature_is_greedy_not_an_overflow():
    """1e-227 would turn logits into inf and the probabilities into NaN (a 500 once)."""
    seqs = seqs_with(4, temperature=1e-227)
    assert all(s.params.greedy for s in seqs)
    rows = torch.tensor([LOGITS] * len(seqs), dtype=torch.float32)
    assert sample(rows, seqs).token_ids == [1] * 4


def test_greedy_rows_ignore_generators_and_mix_with_sampled_rows():
    greedy = Sequence("g", [1], SamplingParams(temperature=0))
    sampled = seqs_with(1, temperature=1.0, top_k=1)[0]
    rows = torch.tensor([LOGITS, [0.0, 0.0, 0.0, 0.0, 5.0]], dtype=torch.float64)
    assert sample(rows, [greedy, sampled]).token_ids == [1, 4]


# -- seeds -------------------------------------------------------------------------------
def test_same_seed_same_output_whatever_shares_the_batch(tiny_path):
    rng = random.Random(0)
    target = rand_prompt(rng, 13)
    sp = SamplingParams(temperature=1.3, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)

    alone = Engine(EngineConfig(model=str(tiny_path), dtype="float64", kv_cache_bytes=SMALL_KV))
    ref = run_all(alone, {0: [("target", target, sp)]})["target"]
    assert len(ref.token_ids) == 24

    # Now amid unseeded and differently seeded neighbours, chunked, in a pool small enough to
    # preempt, arriving before and after it.
    busy = Engine(
        EngineConfig(
            model=str(tiny_path),
            dtype="float64",
            block_size=4,
            num_blocks=24,
            max_num_batched_tokens=16,
        )
    )
    others = {
        0: [
            (f"n{i}", rand_prompt(rng, rng.randint(5, 30)), SamplingParams(max_tokens=20))
            for i in range(3)
        ],
        2: [("target", target, sp)],
        4: [
            (
                f"m{i}",
                rand_prompt(rng, 9),
                SamplingParams(seed=i, temperature=0.7, max_tokens=15, ignore_eos=True),
            )
            for i in range(3)
        ],
    }
    got = run_all(busy, others)
    assert busy.stats().num_preemptions > 0
    assert got["target"].token_ids == ref.token_ids


def test_different_seeds_differ_and_unseeded_requests_vary(llm):
    prompt = rand_prompt(random.Random(1), 10)
    outs = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True)
            for s in (1, 2, 1, 3)
        ],
    )
    assert outs[0].token_ids == outs[2].token_ids
    assert outs[0].token_ids != outs[1].token_ids
    assert len({tuple(o.token_ids) for o in outs}) == 3


def test_top_k_1_equals_greedy(llm):
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (3, 11, 27)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for sp in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=2.0, top_k=1, seed=5, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=16, ignore_eos=True),
    ):
        sampled = llm.generate(prompts, sp)
        assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


# -- log-probabilities -------------------------------------------------------------------
def test_logprobs_of_greedy_tokens_match_transformers(tiny_path, tiny_hf_model, llm):
    hf = tiny_hf_model(tiny_path)
    prompt = rand_prompt(random.Random(3), 12)
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    )
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) == 10
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, (token, lp, top) in enumerate(
        zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
    ):
        row = ref[len(prompt) - 1 + i]
        assert lp <= 0
        assert lp == pytest.approx(float(row[token]), abs=1e-5)  # logprobs are float32
        assert len(top) == 3
        assert token in top and top[token] == pytest.approx(lp)
        assert max(top.values()) == pytest.approx(lp)  # greedy picks the best
        assert sorted(top) == sorted(torch.topk(row, 3).indices.tolist())
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_logprobs_of_sampled_tokens(llm):
    prompt = rand_prompt(random.Random(4), 8)
    sp = SamplingParams(temperature=1.5, seed=3, max_tokens=20, ignore_eos=True, logprobs=5)
    (out,) = llm.generate([prompt], sp)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert all(lp <= 0 for lp in out.logprobs)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 5 and all(v <= 0 for v in top.values())
        if token in top:
            assert top[token] == pytest.approx(lp)
        else:
            assert lp <= min(top.values())


def test_logprobs_zero_and_none(llm):
    prompt = rand_prompt(random.Random(5), 8)
    zero, none = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0),
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        ],
    )
    assert zero.logprobs is not None and len(zero.logprobs) == 4
    assert zero.top_logprobs == [{}, {}, {}, {}]
    assert none.logprobs is None and none.top_logprobs is None
    assert zero.token_ids == none.token_ids


# -- stopping ----------------------------------------------------------------------------
def greedy_reference(llm: LLM, prompt: Any, n: int = 16) -> RequestOutput:
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out


def test_stop_token_ids_end_with_stop(llm):
    prompt = rand_prompt(random.Random(6), 9)
    ref = greedy_reference(llm, prompt).token_ids
    stop_at = ref[6]
    cut = ref.index(stop_at) + 1
    (out,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_at]),
    )
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:cut]  # the stop token is reported, nothing after it
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_stop_string_cuts_the_text_before_it(llm):
    prompt = "w10 w20 w30"
    ref = greedy_reference(llm, prompt)
    words = ref.text.split(" ")
    assert len(words) == 16
    stop = f"{words[4]} {words[5]}"  # spans two tokens
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=stop))
    assert out.finish_reason == "stop"
    first = ref.text.index(stop)
    assert out.text == ref.text[:first]
    assert stop not in out.text
    assert len(out.token_ids) < 16
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]


def test_the_earliest_of_several_stop_strings_wins(llm):
    prompt = "w11 w12"
    ref = greedy_reference(llm, prompt)
    words = ref.text.split(" ")
    late, early = words[9], words[3]
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, stop=[late, early])
    )
    assert out.finish_reason == "stop"
    assert out.text == ref.text[: ref.text.index(early)]


def test_unmatched_stop_string_runs_to_length(llm):
    (out,) = llm.generate(
        ["w1 w2"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop="zzz")
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_streamed_text_only_grows(tiny_path):
    """Text held back for a possible stop string is never retracted."""
    engine = Engine(EngineConfig(model=str(tiny_path), dtype="float64", kv_cache_bytes=SMALL_KV))
    ref = run_all(engine, {0: [("r", "w7 w8", SamplingParams(temperature=0, max_tokens=16))]})
    words = ref["r"].text.split(" ")
    stop = words[8] + " " + words[9][:2]
    engine.add_request("w7 w8", SamplingParams(temperature=0, max_tokens=16, stop=stop), "s")
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step() if o.request_id == "s"]
    for before, after in itertools.pairwise(texts):
        assert after.startswith(before)
    assert texts[-1] == ref["r"].text[: ref["r"].text.index(stop)]


def test_ignore_eos(llm):
    """Without ignore_eos the model's EOS stops the request; with it, generation goes on."""
    prompt = rand_prompt(random.Random(7), 9)
    ref = greedy_reference(llm, prompt, 12).token_ids
    eos_ids = llm.engine.eos_token_ids
    llm.engine.outputs.eos_token_ids = {ref[4]}  # pretend the 5th generated token is the EOS
    try:
        stopped, ignored = llm.generate(
            [prompt, prompt],
            [
                SamplingParams(temperature=0, max_tokens=12),
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            ],
        )
    finally:
        llm.engine.outputs.eos_token_ids = eos_ids
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ref[: ref.index(ref[4]) + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref
