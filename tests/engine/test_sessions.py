"""Agent sessions on a tiny float64 model: greedy multi-turn outputs with session KV reuse (in
memory, spilled to host memory or disk, after a restart, from damaged files) equal outputs
computed from scratch, token for token; deferral keeps FIFO order; the pool is whole after
every workload.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal import LLM, Engine, SamplingParams
from shoal.engine.block_files import HEADER
from shoal.engine.hashing import root_hash, session_hashes
from shoal.engine.session_manifests import manifest_name

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SESSIONS = ["alpha", "beta", "gamma"]
TURNS = 4


def make_engine(model: Path, **kw: Any) -> Engine:
    kw.setdefault("batch_wait_s", 0.0)
    kw.setdefault("num_blocks", 256)
    return Engine(model=str(model), dtype="float64", block_size=BLOCK, **kw)


def user_turns(seed: int = 0) -> list[list[list[int]]]:
    """turns[t][s]: what session s's user adds at turn t (a shared system prompt first)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(10)]
    turns = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] for _ in SESSIONS]
    first = [system + t for t in turns]
    rest = [[[rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] for _ in SESSIONS]]
    for _ in range(TURNS - 2):
        rest.append([[rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] for _ in SESSIONS])
    return [first, *rest]


def run(engine: Engine, prompts: list[list[int]], sids: list[str | None]) -> list[Any]:
    ids = [engine.add_request(p, GREEDY, session_id=s) for p, s in zip(prompts, sids, strict=True)]
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


class Conversation:
    """Three agents talking turn by turn; `history[s]` is session s's whole context."""

    def __init__(self, seed: int = 0) -> None:
        self.turns = user_turns(seed)
        self.history: list[list[int]] = [[] for _ in SESSIONS]
        self.outputs: list[list[list[int]]] = []
        self.cached: list[list[int]] = []

    def play(self, engine: Engine, turns: range, sessions: bool = True) -> None:
        for t in turns:
            prompts = [h + u for h, u in zip(self.history, self.turns[t], strict=True)]
            outs = run(engine, prompts, list(SESSIONS) if sessions else [None] * len(SESSIONS))
            self.outputs.append([o.token_ids for o in outs])
            self.cached.append([o.num_cached_tokens for o in outs])
            self.history = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model: Path) -> Conversation:
    """The same conversation with no cache at all: no prefix caching, no sessions."""
    conv = Conversation()
    conv.play(make_engine(model, enable_prefix_caching=False), range(TURNS), sessions=False)
    return conv


def assert_pool_whole(engine: Engine) -> None:
    """With nothing running, every block is free or held exactly once per session holding it."""
    assert not engine.has_unfinished_requests()
    held: dict[int, int] = {}
    for session in engine.sessions:
        assert not session.running
        for b in session.block_ids:
            held[b] = held.get(b, 0) + 1
    for block in engine.pool.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0)
    assert engine.pool.num_free == sum(b.ref_cnt == 0 for b in engine.pool.blocks)
    for info in engine.list_sessions():
        engine.drop_session(info.session_id)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_sessions_in_memory_match_no_cache(model: Path, reference: Conversation) -> None:
    engine = make_engine(model)
    conv = Conversation()
    conv.play(engine, range(TURNS))
    assert conv.outputs == reference.outputs
    stats = engine.stats()
    assert stats.session_hits == len(SESSIONS) * (TURNS - 1)
    assert stats.disk_reads == stats.disk_writes == 0
    # Turn t reuses every token of turn t-1 but the last one generated, not only whole blocks.
    for t in range(1, TURNS):
        for s in range(len(SESSIONS)):
            expected = sum(len(x[s]) for x in conv.turns[:t]) + sum(
                len(o[s]) for o in conv.outputs[:t]
            )
            assert conv.cached[t][s] == expected - 1
    assert stats.session_tokens_reused == sum(sum(c) for c in conv.cached[1:]) + sum(conv.cached[0])
    assert_pool_whole(engine)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_sessions_spilled_below_the_pool_match_no_cache(
    model: Path, reference: Conversation, tier: str
) -> None:
    host = 1 << 30 if tier == "host" else 0  # no host memory: every eviction goes to disk
    engine = make_engine(model, num_blocks=26, host_kv_bytes=host)  # two contexts do not fit
    conv = Conversation()
    conv.play(engine, range(TURNS))
    assert conv.outputs == reference.outputs
    stats = engine.stats()
    assert stats.kv_host_demotions > 0
    if tier == "host":
        assert stats.kv_host_promotions > 0 and stats.kv_disk_demotions == 0
    else:
        assert stats.kv_disk_promotions > 0 and stats.disk_reads > 0
    assert stats.restore_latency_p95_ms >= stats.restore_latency_p50_ms > 0
    assert_pool_whole(engine)


def test_restart_restores_from_disk(model: Path, reference: Conversation, tmp_path: Path) -> None:
    conv = Conversation()
    first = make_engine(model, cache_dir=str(tmp_path))
    conv.play(first, range(2))
    first.close()
    assert all(i.on_disk and i.saved for i in first.list_sessions())

    second = make_engine(model, cache_dir=str(tmp_path))
    assert {i.session_id for i in second.list_sessions()} == set(SESSIONS)
    assert not any(i.in_memory for i in second.list_sessions())
    conv.play(second, range(2, TURNS))
    assert conv.outputs == reference.outputs
    stats = second.stats()
    assert stats.disk_reads == len(SESSIONS)
    assert stats.session_hits == len(SESSIONS) * 2
    assert conv.cached[2] == [len(h) - 1 for h in reference_history(reference, conv, 2)]
    assert_pool_whole(second)


def reference_history(reference: Conversation, conv: Conversation, t: int) -> list[list[int]]:
    """Each session's context after turn t-1 (its prompt and output, all turns so far)."""
    return [
        [tok for u in range(t) for tok in conv.turns[u][s] + reference.outputs[u][s]]
        for s in range(len(SESSIONS))
    ]


def damage(cache: Path, how: str) -> None:
    """Damage the first block of session "beta" that no other session shares (or its
    manifest)."""
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    manifest = folder / "sessions" / manifest_name("beta")
    if how == "garbage-manifest":
        manifest.write_text("{not json")
        return
    m = json.loads(manifest.read_text())
    root = root_hash(f"{m['fingerprint']}:{m['dtype']}:{m['block_size']}")
    h = session_hashes(root, m["token_ids"], BLOCK)[2]  # blocks 0-1: the shared system prompt
    block = folder / "blocks" / h.hex()[:2] / f"{h.hex()}.kv"
    data = bytearray(block.read_bytes())
    if how == "corrupt":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncated":
        data = data[:-100]
    elif how == "mismatched":  # the header names another block
        data[HEADER.size - 17] ^= 0xFF
    block.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "mismatched", "garbage-manifest"])
def test_damaged_file_is_discarded_and_recomputed(
    model: Path, reference: Conversation, tmp_path: Path, how: str
) -> None:
    conv = Conversation()
    first = make_engine(model, cache_dir=str(tmp_path))
    conv.play(first, range(2))
    first.close()
    damage(tmp_path, how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = make_engine(model, cache_dir=str(tmp_path))
        conv.play(second, range(2, 3))
    assert conv.outputs == reference.outputs[:3]
    assert conv.cached[2][0] > 0 and conv.cached[2][2] > 0  # the others were restored
    if how == "garbage-manifest":  # the session is forgotten; its blocks still serve its prefix
        assert any("session manifest" in str(w.message) for w in caught)
        assert conv.cached[2][1] > 0
    else:
        assert any("KV block" in str(w.message) for w in caught)
        assert conv.cached[2][1] == 2 * BLOCK  # beta recomputed past the shared blocks
        assert second.stats().disk_reads == 2
    assert_pool_whole(second)


def test_deferred_requests_keep_fifo_and_do_not_block_others(model: Path) -> None:
    engine = make_engine(model)
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a1 = engine.add_request([5, 6, 7, 8, 9], long, session_id="a")
    a2 = engine.add_request([5, 6, 7, 8, 9, 10], GREEDY, session_id="a")
    b1 = engine.add_request([11, 12, 13], GREEDY, session_id="b")
    a3 = engine.add_request([5, 6, 7], GREEDY, session_id="a")
    started: dict[str, int] = {}
    ended: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            started.setdefault(out.request_id, step)
            if out.finished:
                ended[out.request_id] = step
        running = [s.session_id for s in engine.scheduler.running]
        assert len(running) == len(set(running)), "two requests of one session ran together"
    assert set(ended) == {a1, a2, b1, a3}
    assert started[b1] == 1  # the busy session "a" did not hold up "b"
    assert ended[a1] < started[a2] and ended[a2] < started[a3]  # FIFO within the session
    assert_pool_whole(engine)


def test_llm_api_sessions_and_context_manager(model: Path, tmp_path: Path) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    with LLM(
        str(model), dtype="float64", block_size=BLOCK, cache_dir=str(tmp_path), num_blocks=256
    ) as llm:
        outs = llm.generate(prompts, GREEDY, session_id=["x", "y"])
        info = llm.sessions["x"]
        assert info.num_tokens == len(prompts[0]) + GREEDY.max_tokens - 1
        assert info.in_memory and not info.on_disk and info.num_blocks == 3
        assert "y" in llm.sessions and len(llm.sessions) == 2
        assert llm.sessions.drop("y") and "y" not in llm.sessions
        again = llm.generate(prompts[0] + outs[0].token_ids + [3], GREEDY, session_id="x")
        assert again[0].num_cached_tokens == info.num_tokens
    sessions = next(tmp_path.iterdir()) / "sessions"
    assert (sessions / manifest_name("x")).exists()
    reopened = LLM(
        str(model), dtype="float64", block_size=BLOCK, cache_dir=str(tmp_path), num_blocks=256
    )
    (info,) = reopened.sessions.list()
    assert info.session_id == "x" and info.on_disk and not info.in_memory
    reopened.sessions.clear()
    assert len(reopened.sessions) == 0 and not list(sessions.iterdir())
