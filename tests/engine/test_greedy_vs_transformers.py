"""Greedy decoding through the paged engine equals transformers' `generate()` token for token.

Tiny random float64 models (see conftest) make ties impossible, so any difference is a bug:
a wrong slot, a stale block, a bad mask, a misapplied RoPE or a chunk boundary off by one.
Every workload ends with the whole pool free again.
"""

from __future__ import annotations

import random

import pytest
from greedy_cases import (
    assert_pool_whole,
    check_against_hf,
    greedy,
    hf_greedy,
    make_engine,
    make_llm,
    random_prompt,
    run_staggered,
)

from shoal import SamplingParams

pytestmark = pytest.mark.usefixtures("cpu_path", "speculation", "decode_graphs")


ALL_KINDS = ["llama", "llama-tied", "llama3-rope", "qwen3", "qwen2", "mistral"]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_single_request_matches_transformers(kind, tiny_model_dir, tiny_hf_model):
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    llm = make_llm(path)
    assert llm.tokenizer is None
    prompt = random_prompt(random.Random(kind), 37)
    (out,) = llm.generate([prompt], greedy(24))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 24
    assert len(set(out.token_ids)) > 3, "degenerate tiny model: the test would prove little"
    assert out.token_ids == hf_greedy(hf, path, prompt, 24)
    assert_pool_whole(llm.engine)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_staggered_arrivals_match_transformers(kind, tiny_model_dir, tiny_hf_model):
    """Ten requests of different lengths join a running batch at different steps."""
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(1)
    engine = make_engine(path, block_size=8)
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    requests = []
    for i in range(10):
        req = (f"r{i}", random_prompt(rng, rng.randint(1, 60)), rng.randint(1, 20))
        requests.append(req)
        arrivals.setdefault(rng.choice([0, 0, 1, 2, 3, 5, 8, 13]), []).append(req)
    done = run_staggered(engine, arrivals)
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_chunked_prefill_matches_transformers(kind, tiny_model_dir, tiny_hf_model):
    """A 16-token budget splits long prompts into chunks that run beside decodes."""
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(2)
    engine = make_engine(path, block_size=4, max_num_batched_tokens=16)
    requests = [(f"c{i}", random_prompt(rng, n), 12) for i, n in enumerate([5, 70, 33, 16, 17])]
    arrivals = {0: requests[:2], 3: requests[2:4], 6: requests[4:]}

    chunked = False
    original_schedule = engine.scheduler.schedule

    def spy():
        nonlocal chunked
        batch = original_schedule()
        assert batch.num_tokens <= 16
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            if start + n < seq.num_prompt_tokens and n > 1:
                chunked = True
        return batch

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    done = run_staggered(engine, arrivals)
    assert chunked, "no prompt was prefilled in chunks"
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_preemption_under_a_tiny_pool_matches_transformers(kind, tiny_model_dir, tiny_hf_model):
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(3)
    # Each request needs up to 8 blocks of 4 tokens; six of them cannot all fit in 14 blocks.
    engine = make_engine(path, block_size=4, num_blocks=14, enable_prefix_caching=False)
    requests = [(f"p{i}", random_prompt(rng, rng.randint(6, 12)), 20) for i in range(6)]
    done = run_staggered(engine, {0: requests[:4], 2: requests[4:]})
    assert engine.stats().num_preemptions > 0
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)


def test_preemption_with_prefix_caching_matches_transformers(tiny_model_dir, tiny_hf_model):
    """Recomputing a preempted request may reuse its own cached blocks: still exact."""
    path = tiny_model_dir("llama")
    hf = tiny_hf_model(path)
    rng = random.Random(4)
    engine = make_engine(path, block_size=4, num_blocks=12)
    shared = random_prompt(rng, 8)
    requests = [(f"q{i}", shared + random_prompt(rng, rng.randint(1, 6)), 24) for i in range(5)]
    done = run_staggered(engine, {0: requests[:3], 1: requests[3:]})
    assert engine.stats().num_preemptions > 0
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prefix_cache_hits_match_transformers(kind, tiny_model_dir, tiny_hf_model):
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(5)
    engine = make_engine(path, block_size=4)
    system = random_prompt(rng, 23)
    first = ("s0", system + random_prompt(rng, 5), 10)
    later = [
        ("s1", system + random_prompt(rng, 9), 10),
        ("s2", system[:12], 10),  # a prefix of the cached prompt, exactly 3 blocks long
        ("s3", first[1], 10),  # the very same prompt: its last token is still computed
        ("s4", first[1] + hf_greedy(hf, path, first[1], 10)[:6], 8),  # prompt + its answer
    ]
    done = run_staggered(engine, {0: [first]})
    assert engine.stats().prefix_cache_hit_rate == 0
    done |= run_staggered(engine, {0: later})
    stats = engine.stats()
    assert stats.prefix_cache_hit_rate > 0
    for rid in ("s1", "s2", "s3", "s4"):
        assert done[rid].num_cached_tokens > 0, rid
    assert done["s2"].num_cached_tokens == 8  # the last full block holds the last token
    assert done["s3"].num_cached_tokens == 24  # 28 tokens: 7 blocks, the 7th is recomputed
    assert done["s4"].num_cached_tokens >= 28  # generated tokens were cached too
    check_against_hf(hf, path, [first, *later], done)
    assert_pool_whole(engine)


def test_concurrent_shared_prefix_requests_match_transformers(tiny_model_dir, tiny_hf_model):
    """Requests sharing blocks while running together (ref counts > 1)."""
    path = tiny_model_dir("qwen3")
    hf = tiny_hf_model(path)
    rng = random.Random(6)
    engine = make_engine(path, block_size=4, max_num_batched_tokens=32)
    system = random_prompt(rng, 20)
    requests = [(f"t{i}", system + random_prompt(rng, rng.randint(1, 10)), 12) for i in range(8)]
    done = run_staggered(engine, {0: requests[:1], 3: requests[1:4], 4: requests[4:]})
    assert engine.stats().prefix_cache_hit_rate > 0
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_kv_from_each_tier_matches_transformers(kind, tiny_model_dir, tiny_hf_model, tmp_path):
    """A conversation resent whole finds its KV in the pool, then in host memory (other
    traffic took the pool), then on disk (a new engine): each turn equals transformers."""
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(9)
    store = {"block_size": 4, "num_blocks": 24, "cache_dir": str(tmp_path)}
    engine = make_engine(path, **store)
    history = random_prompt(rng, 30)
    turns, done = [], {}
    for tier in ("pool", "host", "disk"):
        if tier == "host":
            run_staggered(engine, {0: [("other", random_prompt(rng, 80), 1)]})
        if tier == "disk":
            engine.close()
            engine = make_engine(path, **store)
        history = history + random_prompt(rng, 2)
        turn = (tier, history, 6)
        done |= run_staggered(engine, {0: [turn]})
        turns.append(turn)
        history = history + done[tier].token_ids
        if tier != "pool":
            assert done[tier].num_cached_tokens >= 28, tier
        if tier == "host":
            assert engine.stats().kv_host_promotions > 0, "the turn did not come from host memory"
    assert engine.stats().kv_disk_promotions > 0, "the last turn did not come from the disk"
    check_against_hf(hf, path, turns, done)
    assert_pool_whole(engine)


def test_prefix_caching_disabled_never_hits(tiny_model_dir, tiny_hf_model):
    path = tiny_model_dir("llama")
    hf = tiny_hf_model(path)
    engine = make_engine(path, block_size=4, enable_prefix_caching=False)
    prompt = random_prompt(random.Random(7), 21)
    requests = [("a", prompt, 6), ("b", prompt, 6)]
    done = run_staggered(engine, {0: requests[:1], 9: requests[1:]})
    assert engine.stats().prefix_cache_hit_rate == 0
    assert done["b"].num_cached_tokens == 0
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2"])
def test_block_size_256_matches_transformers(kind, tiny_model_dir, tiny_hf_model):
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(8)
    engine = make_engine(path, block_size=256)
    # One prompt crosses a block boundary (300 + 10 > 256); a second reuses its first block.
    long_prompt = random_prompt(rng, 300)
    requests = [
        ("long", long_prompt, 10),
        ("short", random_prompt(rng, 9), 10),
        ("mid", random_prompt(rng, 250), 12),
    ]
    done = run_staggered(engine, {0: requests[:2], 2: requests[2:]})
    again = [("again", [*long_prompt[:257], 5], 4)]
    done |= run_staggered(engine, {0: again})
    assert done["again"].num_cached_tokens == 256
    check_against_hf(hf, path, requests + again, done)
    assert_pool_whole(engine)


def test_max_model_len_ends_with_length(tiny_model_dir, tiny_hf_model):
    """A request that reaches the model's context limit stops there with "length"."""
    path = tiny_model_dir("llama")
    hf = tiny_hf_model(path)
    engine = make_engine(path, block_size=4, max_model_len=40)
    prompt = random_prompt(random.Random(9), 30)
    done = run_staggered(engine, {0: [("x", prompt, 100)]})
    out = done["x"]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 40
    assert out.token_ids == hf_greedy(hf, path, prompt, 10)
    assert_pool_whole(engine)


def test_eos_finishes_with_stop_and_is_included(tiny_model_dir, tiny_hf_model):
    """Without ignore_eos the model's own EOS ends the request with "stop"."""
    path = tiny_model_dir("llama")
    hf = tiny_hf_model(path)
    llm = make_llm(path)
    prompt = random_prompt(random.Random(10), 15)
    reference = hf_greedy(hf, path, prompt, 12)
    # Make some generated token the engine's EOS: the request must stop right after it.
    eos = reference[5]
    cut = reference.index(eos) + 1
    llm.engine.outputs.eos_token_ids = {eos}
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[:cut]
    (out,) = llm.generate([prompt], greedy(12))
    assert out.finish_reason == "length"
    assert out.token_ids == reference
    assert_pool_whole(llm.engine)


def test_outputs_come_back_in_prompt_order(tiny_model_dir, tiny_hf_model):
    path = tiny_model_dir("qwen2")
    hf = tiny_hf_model(path)
    llm = make_llm(path, block_size=8)
    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (40, 3, 25, 1, 12, 60, 7, 18, 33)]
    params = [greedy(n) for n in (3, 9, 1, 6, 4, 2, 8, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf, path, prompt, sp.max_tokens)
    assert_pool_whole(llm.engine)


def test_reset_aborts_everything_and_frees_the_pool(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), block_size=4)
    rng = random.Random(12)
    for i in range(5):
        engine.add_request(random_prompt(rng, 20), greedy(50), request_id=f"z{i}")
    engine.step()
    engine.step()
    assert engine.stats().blocks_used > 0
    outs = engine.reset()
    assert sorted(o.request_id for o in outs) == [f"z{i}" for i in range(5)]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.kv_bytes_used == 0 and stats.kv_usage_ratio == 0
