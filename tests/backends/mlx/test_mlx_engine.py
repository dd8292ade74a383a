"""BlockPoolBatchEngine on a tiny random llama: design input 001's test list."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_helpers import EngineFactory, run
from mlx_lm.generate import generate_step

from shoal.backends.mlx import AgentBlocks
from shoal.backends.mlx.kv import as_caches
from shoal.engine.block_pool import cdiv
from shoal.engine.sessions import SessionState
from shoal.errors import (
    CacheCorruptionError,
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
)


def reference(model: Any, tokens: list[int], n: int) -> list[int]:
    """mlx-lm's own single-sequence greedy decoding."""
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


def prompt_ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 100 for i in range(n)]


def test_import_needs_no_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import shoal.backends.mlx"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_submit_without_cache_allocates_blocks_and_step_yields_the_completion(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    uid = engine.submit("a", prompt_ids(1, 40), max_tokens=10)
    assert next(engine.step(), None) is None  # admitted and prefilled, nothing finished yet
    assert engine.pool.num_used == cdiv(40, 16)
    (c,) = run(engine).values()
    assert (c.uid, c.agent_id, c.finish_reason, c.token_count) == (uid, "a", "length", 10)
    assert c.num_cached_tokens == 0 and len(c.token_ids) == 10
    assert c.blocks.token_ids == tuple(prompt_ids(1, 40) + c.token_ids)
    assert len(c.blocks.block_ids) == cdiv(50, 16) == engine.pool.num_used


def test_submit_with_cache_reuses_the_agent_kv_and_matches_a_recompute(
    make_engine: EngineFactory, tiny_model: Any
) -> None:
    engine = make_engine()
    first = run_one(engine, "a", prompt_ids(2, 30), 12)
    second = run_one(engine, "a", prompt_ids(3, 9), 15, cache=first.blocks)
    assert second.num_cached_tokens == first.blocks.num_tokens == 42
    whole = prompt_ids(2, 30) + first.token_ids + prompt_ids(3, 9)
    assert second.token_ids == reference(tiny_model, whole, 15)
    assert engine.sessions.stats.tokens_reused == 42


def test_a_busy_agent_waits_its_turn_and_then_reuses_the_first_turn(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    first = engine.submit("a", prompt_ids(4, 20), max_tokens=5)
    other = engine.submit("b", prompt_ids(5, 20), max_tokens=5)
    second = engine.submit("a", prompt_ids(4, 20), max_tokens=5)
    engine.step()
    assert {r.uid for r in engine._running.values()} == {first, other}  # deferred, not refused
    done = run(engine)
    assert done[second].num_cached_tokens == 19  # the last prompt token is always computed
    assert done[second].token_ids == done[first].token_ids


def test_reconstruction_gives_each_layer_its_tokens_in_order(make_engine: EngineFactory) -> None:
    engine = make_engine(block_tokens=16)
    c = run_one(engine, "a", prompt_ids(6, 50), 7)
    n, spec = c.blocks.num_tokens, engine.spec
    layers = engine.data.gather(list(c.blocks.block_ids), n)
    assert len(layers) == spec.num_layers
    assert all(k.shape == v.shape == (1, spec.kv_heads, n, spec.head_dim) for k, v in layers)
    # Scatter the same bytes over blocks that live in different slabs: concatenation agrees.
    ids = list(c.blocks.block_ids)
    for i, b in enumerate(ids):
        piece = [
            (k[:, :, i * 16 : (i + 1) * 16], v[:, :, i * 16 : (i + 1) * 16]) for k, v in layers
        ]
        engine.data.put([b], piece, min(16, n - i * 16))
    again = engine.data.gather(ids, n)
    assert all(
        mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
        for a, b in zip(layers, again, strict=True)
    )
    assert [cache.offset for cache in as_caches(again, n)] == [n] * spec.num_layers
    with pytest.raises(CacheCorruptionError):
        engine.data.gather([engine.pool.num_blocks - 1], 5)  # a block that holds nothing


def test_save_load_resume_round_trip(
    make_engine: EngineFactory, tmp_path: Path, tiny_model: Any
) -> None:
    first_engine = make_engine(cache_dir=tmp_path)
    first = run_one(first_engine, "a", prompt_ids(7, 40), 10)
    first_engine.close()  # saves the agent's KV
    restarted = make_engine(cache_dir=tmp_path)
    assert restarted.session_info("a").state == SessionState.SPILLED.value  # type: ignore[union-attr]
    resumed = run_one(restarted, "a", prompt_ids(8, 6), 12, cache=first.blocks)
    assert resumed.num_cached_tokens == 50 and restarted.sessions.stats.disk_reads == 1
    whole = prompt_ids(7, 40) + first.token_ids + prompt_ids(8, 6)
    assert resumed.token_ids == reference(tiny_model, whole, 12)


def test_a_damaged_session_file_is_discarded_and_the_turn_recomputed(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    first_engine = make_engine(cache_dir=tmp_path)
    first = run_one(first_engine, "a", prompt_ids(9, 40), 10)
    expected = run_one(first_engine, "a", prompt_ids(10, 5), 8, cache=first.blocks).token_ids
    first_engine.drop_session("a")
    first = run_one(first_engine, "a", prompt_ids(9, 40), 10)
    first_engine.close()
    for block in tmp_path.rglob("*.kv"):  # every block the session's KV was stored in
        data = bytearray(block.read_bytes())
        data[-100] ^= 0xFF
        block.write_bytes(bytes(data))
    restarted = make_engine(cache_dir=tmp_path)
    with pytest.warns(UserWarning, match="checksum mismatch"):
        again = run_one(restarted, "a", prompt_ids(10, 5), 8, cache=first.blocks)
    assert again.num_cached_tokens == 0 and again.token_ids == expected


def test_blocks_extend_exactly_at_256_token_boundaries(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=8, block_tokens=256)
    engine.submit("a", prompt_ids(11, 250), max_tokens=270)
    seen = []
    while engine.has_work:
        done = list(engine.step())
        req = next(iter(engine._running.values()), None)
        tokens = req.seq.num_computed_tokens if req else done[0].blocks.num_tokens
        seen.append((tokens, engine.pool.num_used))
    assert all(used == cdiv(tokens, 256) for tokens, used in seen)
    assert {used for _, used in seen} == {1, 2, 3}
    assert seen[-1] == (520, 3)


def test_pool_exhaustion_mid_decode_ends_that_request_with_its_own_reason(
    make_engine: EngineFactory, tiny_model: Any
) -> None:
    engine = make_engine(num_blocks=4, block_tokens=16)
    a = engine.submit("a", prompt_ids(12, 20), max_tokens=40)
    b = engine.submit("b", prompt_ids(13, 20), max_tokens=40)
    done = run(engine)
    reasons = sorted(c.finish_reason for c in done.values())
    assert reasons == ["length", "pool_exhausted"]
    short = next(c for c in done.values() if c.finish_reason == "pool_exhausted")
    assert short.token_count < 40
    assert short.blocks.num_tokens == 32 == 16 * len(short.blocks.block_ids) or (
        short.blocks.num_tokens == 0  # spilled away so the other could finish
    )
    prompt = prompt_ids(12, 20) if short.uid == a else prompt_ids(13, 20)
    assert short.token_ids == reference(tiny_model, prompt, short.token_count)
    assert {a, b} == set(done)
    with pytest.raises(PoolExhaustedError):
        engine.submit("c", prompt_ids(14, 64), max_tokens=1)  # 65 tokens > 4 blocks of 16


def test_cancel_removes_a_request_mid_flight_and_keeps_its_kv(make_engine: EngineFactory) -> None:
    engine = make_engine()
    uid = engine.submit("a", prompt_ids(15, 30), max_tokens=100)
    for _ in range(5):
        assert not list(engine.step())
    engine.cancel(uid)
    (c,) = engine.step()
    assert c.finish_reason == "abort" and 0 < c.token_count < 100
    assert c.blocks.num_tokens == 30 + c.token_count
    waiting = engine.submit("b", prompt_ids(16, 30), max_tokens=100)
    engine.cancel(waiting)
    (c,) = engine.step()
    assert (c.uid, c.finish_reason, c.token_count) == (waiting, "abort", 0)


def test_concurrent_submits_all_complete(make_engine: EngineFactory) -> None:
    engine = make_engine()
    uids: list[int] = []

    def submit(i: int) -> None:
        for j in range(5):
            uids.append(engine.submit(f"agent-{i}-{j}", prompt_ids(i * 5 + j, 10), max_tokens=3))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(uids)) == 20
    assert set(run(engine)) == set(uids)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"agent_id": "", "prompt": "hi"}, InvalidRequestError),
        ({"agent_id": 7, "prompt": "hi"}, InvalidRequestError),
        ({"agent_id": "a", "prompt": ""}, InvalidRequestError),
        ({"agent_id": "a", "prompt": []}, InvalidRequestError),
        ({"agent_id": "a", "prompt": [1, 10**9]}, InvalidRequestError),
        ({"agent_id": "a", "prompt": "hi", "max_tokens": 0}, InvalidRequestError),
        ({"agent_id": "a", "prompt": "hi", "max_tokens": True}, InvalidRequestError),
        ({"agent_id": "a", "prompt": [5] * 9000}, PromptTooLongError),
        (
            {"agent_id": "a", "prompt": [5], "cache": AgentBlocks("b", (5,), (0,), 16)},
            InvalidRequestError,
        ),
        (
            {"agent_id": "a", "prompt": [5], "cache": AgentBlocks("a", (5,), (0,), 8)},
            CacheCorruptionError,
        ),
        (
            {"agent_id": "a", "prompt": [5], "cache": AgentBlocks("a", (5,) * 20, (0,), 16)},
            CacheCorruptionError,
        ),
    ],
)
def test_invalid_requests_raise_typed_errors(
    make_engine: EngineFactory, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    engine = make_engine()
    with pytest.raises(error):
        engine.submit(**kwargs)
    assert not engine.has_work


def test_greedy_equals_mlx_lm_generate_for_agents_of_100_500_and_2000_tokens(
    make_engine: EngineFactory, tiny_model: Any
) -> None:
    engine = make_engine(num_blocks=200, block_tokens=256)
    lengths = {"short": 100, "medium": 500, "long": 2000}
    prompts = {name: prompt_ids(i + 20, 30 + 10 * i) for i, name in enumerate(lengths)}
    uids = {engine.submit(name, prompts[name], max_tokens=n): name for name, n in lengths.items()}
    done = run(engine)
    for uid, name in uids.items():
        assert done[uid].token_ids == reference(tiny_model, prompts[name], lengths[name]), name


def run_one(engine: Any, agent: str, prompt: list[int], n: int, **kw: Any) -> Any:
    uid = engine.submit(agent, prompt, max_tokens=n, **kw)
    return run(engine)[uid]
