"""Greedy decoding equals transformers' with draft tokens kept and rejected, and across a
session's turns, whose reused KV a rejected draft must never reach (see test_greedy_vs_transformers
for the reference and the axes every case runs along)."""

from __future__ import annotations

import random

import pytest
from greedy_cases import (
    assert_pool_whole,
    check_against_hf,
    greedy,
    hf_greedy,
    make_engine,
    random_prompt,
    run_staggered,
)

from shoal.outputs import RequestOutput

pytestmark = pytest.mark.usefixtures("cpu_path", "speculation", "decode_graphs")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_speculation_keeps_and_rejects_drafts_like_transformers(
    kind, tiny_model_dir, tiny_hf_model, speculation
):
    """Prompts that repeat themselves make prompt lookup propose drafts the model keeps and
    drafts it rejects, beside plain random prompts; block sizes cut drafts across blocks."""
    path = tiny_model_dir(kind)
    hf = tiny_hf_model(path)
    rng = random.Random(11)
    engine = make_engine(path, block_size=4)
    requests = []
    for i in range(8):
        motif = random_prompt(rng, rng.randint(2, 6))
        prompt = (motif * 12)[: rng.randint(10, 60)] if i % 4 else random_prompt(rng, 40)
        requests.append((f"s{i}", prompt, rng.randint(8, 40)))
    done = run_staggered(engine, {0: requests[:5], 4: requests[5:]})
    check_against_hf(hf, path, requests, done)
    assert_pool_whole(engine)
    stats = engine.stats()
    if speculation:
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    else:
        assert stats.spec_draft_tokens == 0
    assert stats.num_generated_tokens == sum(n for _, _, n in requests)


def test_session_turns_match_transformers(tiny_model_dir, tiny_hf_model):
    """Each turn of a session extends the last (its KV reused, the last partial block copied on
    write); with speculation, what rejected drafts wrote past a turn's end is never reused."""
    path = tiny_model_dir("llama")
    hf = tiny_hf_model(path)
    rng = random.Random(5)
    engine = make_engine(path, block_size=4)
    history = (random_prompt(rng, 3) * 5)[:13]
    for turn in range(4):
        history += random_prompt(rng, rng.randint(1, 6))
        engine.add_request(history, greedy(10), request_id=f"t{turn}", session_id="s")
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        out = done[f"t{turn}"]
        assert out.token_ids == hf_greedy(hf, path, history, 10), turn
        if turn:
            assert out.num_cached_tokens > 0  # the session's KV was reused
        history += out.token_ids
