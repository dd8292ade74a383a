"""The shared session tier: a session moves between engines sharing a tier folder and is
restored there, not recomputed; a kill -9 one second after a turn is acknowledged loses that
turn to no one; damaged or older copies are never used. Outputs equal a no-cache run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal import Engine, SamplingParams
from shoal.engine.session_files import KVLayout, session_key
from shoal.engine.session_tier import SessionTier
from shoal.engine.tier_files import MAX_CHUNKS

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
P1 = [5, 6, 7, 8, 9, 10, 11, 12, 13]
MORE = [[14, 15, 16], [17, 18], [19, 20, 21, 22]]


def make_engine(model: Path, **kw: Any) -> Engine:
    return Engine(
        model=str(model), dtype="float64", block_size=4, num_blocks=128, batch_wait_s=0.0, **kw
    )


def turn(engine: Engine, prompt: list[int], session: str | None) -> tuple[list[int], int]:
    rid = engine.add_request(prompt, PARAMS, session_id=session)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = (out.token_ids, out.num_cached_tokens)
    return result


def reference(model: Path, turns: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) of each turn of the conversation, computed from scratch."""
    engine = make_engine(model, enable_prefix_caching=False)
    prompt, out = list(P1), []
    result = []
    for t in range(turns):
        if t:
            prompt = prompt + out + MORE[t - 1]
        out, _ = turn(engine, prompt, None)
        result.append((prompt, out))
    return result


def test_a_session_moves_between_engines_through_the_tier(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model_dir("llama")
    conv = reference(model, 4)
    tier = str(tmp_path / "tier")
    a = make_engine(model, cache_dir=str(tmp_path / "a"), session_tier_dir=tier)
    b = make_engine(model, cache_dir=str(tmp_path / "b"), session_tier_dir=tier)
    served = [a, b, b, a]  # the session moves to b, stays, and comes back to a
    for t, engine in enumerate(served):
        prompt, expected = conv[t]
        out, cached = turn(engine, prompt, "s")
        assert out == expected, f"turn {t + 1}"
        if t == 1:  # b never saw the session: all of turn 1 comes from a's tier copy
            prev_prompt, prev_out = conv[0]
            assert cached == len(prev_prompt) + len(prev_out) - 1
        if t == 3:  # a still holds turn 1 in its pool, but the tier's turn 3 covers more
            prev_prompt, prev_out = conv[2]
            assert cached == len(prev_prompt) + len(prev_out) - 1
        if t:
            assert cached > 0
        engine.sessions.flush()  # the turn's tier write is done before the next engine looks
    assert b.stats().tier_reads == 1 and a.stats().tier_reads == 1
    assert a.stats().tier_writes == 2 and b.stats().tier_writes == 2
    for engine in (a, b):
        assert engine.pool.num_free == engine.pool.num_blocks - engine.stats().blocks_used
        engine.drop_session("s")
        assert engine.pool.num_free == engine.pool.num_blocks
    assert not list((tmp_path / "tier").glob("*/*.json"))  # drop forgets the tier copy too


CHILD = """
import sys, time
from pathlib import Path
from shoal import Engine, SamplingParams

model, cache, tier, marker = sys.argv[1:5]
engine = Engine(model=model, dtype="float64", block_size=4, num_blocks=128, batch_wait_s=0.0,
                cache_dir=cache, session_tier_dir=tier)
params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

def turn(prompt):
    engine.add_request(prompt, params, session_id="s")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.token_ids
    return tokens

p1 = {P1!r}
o1 = turn(p1)
engine.save_sessions()  # the local disk holds turn 1 (as after an idle save)
o2 = turn(p1 + o1 + {MORE0!r})  # turn 2 is acknowledged here, never saved locally
engine.sessions.tier.drain()  # the write-behind copy has landed (its lag is on /metrics)
Path(marker).write_text(str(engine.stats().tier_lag_max_ms))
time.sleep(600)
"""


def test_kill_9_after_a_turns_tier_copy_landed_loses_nothing(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """A turn acknowledged before a kill -9 is restored after it once its write-behind copy
    has landed (the child waits for that, not for a time, so any CPU gives the same run)."""
    model = tiny_model_dir("llama")
    cache, tier, marker = tmp_path / "cache", tmp_path / "tier", tmp_path / "acked"
    repo = Path(__file__).resolve().parents[2]
    code = CHILD.format(P1=P1, MORE0=MORE[0])
    argv = [sys.executable, "-c", code, str(model), str(cache), str(tier), str(marker)]
    child = subprocess.Popen(argv, cwd=repo)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the child exited early"
            assert time.monotonic() < deadline, "the child never acknowledged its turn"
            time.sleep(0.02)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    conv = reference(model, 3)
    restarted = make_engine(model, cache_dir=str(cache), session_tier_dir=str(tier))
    (info,) = restarted.list_sessions()
    assert info.num_tokens == len(P1) + len(conv[0][1]) - 1  # the local disk: turn 1 only
    prompt, expected = conv[2]
    out, cached = turn(restarted, prompt, "s")
    assert out == expected
    p2, o2 = conv[1]
    assert cached == len(p2) + len(o2) - 1  # all of turn 2, from the tier
    assert restarted.stats().tier_reads == 1


def test_a_damaged_tier_copy_is_recomputed_not_used(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model_dir("llama")
    conv = reference(model, 2)
    tier = tmp_path / "tier"
    a = make_engine(model, session_tier_dir=str(tier))
    turn(a, conv[0][0], "s")
    a.sessions.flush()
    (manifest,) = tier.glob("*/*.json")
    first = json.loads(manifest.read_text())["chunks"][0]["file"]
    tensor = manifest.parent / first
    data = bytearray(tensor.read_bytes())
    data[-3] ^= 0xFF
    tensor.write_bytes(bytes(data))
    b = make_engine(model, session_tier_dir=str(tier))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, cached = turn(b, conv[1][0], "s")
    assert out == conv[1][1] and cached == 0
    assert any("checksum" in str(w.message) for w in caught)
    assert tensor.exists()  # a reader never deletes what may be another writer's


class BytesCodec:
    """Session KV as plain bytes, one per (block, layout element): enough to test files."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def snapshot(self, block_ids: list[int]) -> list[int]:
        return list(block_ids)

    def nbytes(self, kv: list[int]) -> int:
        return len(kv)

    def encode(self, kv: list[int]) -> tuple[list[int], bytes]:
        lay = self.layout
        shape = [lay.num_layers, 2, len(kv), lay.block_size, lay.kv_heads, lay.head_dim]
        return shape, bytes(b % 256 for b in kv for _ in range(2 * lay.block_size))

    def read(self, path: Path) -> bytes:
        return path.read_bytes()

    def describe(self, kv: bytes) -> tuple[list[int], str]:
        n = len(kv) // (2 * self.layout.block_size)
        return self.layout.shape(n * self.layout.block_size), self.layout.dtype

    def join(self, parts: list[bytes]) -> bytes:
        return b"".join(parts)


def kv_of(tier: SessionTier, block_ids: list[int]) -> bytes:
    """The bytes a copy of `block_ids` loads as."""
    return BytesCodec(tier.layout).encode(block_ids)[1]


def chunk_files(tier: SessionTier) -> set[str]:
    return {p.name for p in tier.dir.glob("*.safetensors")}


def test_an_older_turn_never_replaces_a_later_one(tmp_path: Path) -> None:
    layout = KVLayout("fp", "uint8", 4, 1, 1, 1)
    tier = SessionTier(layout, tmp_path, BytesCodec(layout))
    later = list(range(1, 10))
    tier.publish("s", later, [1, 2, 3], 1.0)
    assert tier.drain(10)
    tier.publish("s", later[:5], [1, 2], 2.0)  # a slow replica's older turn, written late
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == later
    assert tier.stats.writes == 1 and tier.stats.superseded == 1
    assert tier.load(m) is not None
    other = [1, 2, 3, 4, 99]  # not a prefix: another conversation under the same id replaces it
    tier.publish("s", other, [7, 8], 3.0)
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == other
    assert chunk_files(tier) == m.files  # the replaced chunks are gone
    assert tier.load(m) == kv_of(tier, [7, 8])
    manifest = json.loads((tier.dir / f"{session_key('s')}.json").read_text())
    assert manifest["fingerprint"] == "fp"
    tier.delete("s")
    assert tier.peek("s") is None and not list(tier.dir.iterdir())


def test_a_later_turn_writes_only_its_new_blocks(tmp_path: Path) -> None:
    layout = KVLayout("fp", "uint8", 4, 1, 1, 1)
    tier = SessionTier(layout, tmp_path, BytesCodec(layout))
    turn1 = list(range(1, 10))  # blocks 0-1 full, block 2 holds one token
    tier.publish("s", turn1, [11, 12, 13], 1.0)
    assert tier.drain(10)
    m1 = tier.peek("s")
    assert m1 is not None
    assert [(c.first_block, c.num_blocks) for c in m1.chunks] == [(0, 2), (2, 1)]
    turn2 = [*turn1, 10, 11, 12, 13, 14]  # blocks 0-2 full, block 3 holds two tokens
    tier.publish("s", turn2, [11, 12, 13, 14], 2.0)
    assert tier._pending["s"].nbytes == 2  # only blocks 2 and 3 are copied
    assert tier.drain(10)
    m2 = tier.peek("s")
    assert m2 is not None and m2.token_ids == turn2
    assert m2.chunks[0] == m1.chunks[0]  # kept, not written again
    assert [(c.first_block, c.num_blocks) for c in m2.chunks] == [(0, 2), (2, 1), (3, 1)]
    assert chunk_files(tier) == m2.files  # turn 1's last block went with its manifest
    other = SessionTier(layout, tmp_path, BytesCodec(layout))  # another engine reads it whole
    assert other.load(m2) == kv_of(tier, [11, 12, 13, 14])
    edited = [*turn1[:5], 99, 98, 97, 96, 95]  # the history changed in block 1, which the
    tier.publish("s", edited, [11, 22, 23], 3.0)  # first chunk holds: nothing is kept
    assert tier._pending["s"].nbytes == 3
    assert tier.drain(10)
    m3 = tier.peek("s")
    assert m3 is not None and [(c.first_block, c.num_blocks) for c in m3.chunks] == [(0, 2), (2, 1)]
    assert not m3.files & m2.files
    assert other.load(m3) == kv_of(tier, [11, 22, 23]) and chunk_files(tier) == m3.files


def test_a_long_session_keeps_a_short_chain(tmp_path: Path) -> None:
    layout = KVLayout("fp", "uint8", 2, 1, 1, 1)
    tier = SessionTier(layout, tmp_path, BytesCodec(layout))
    tokens: list[int] = []
    for t in range(3 * MAX_CHUNKS):
        tokens += [t, t + 1, t + 2]  # each turn fills a block and a half
        blocks = list(range(100, 100 + (len(tokens) + 1) // 2))
        tier.publish("s", tokens, blocks, float(t))
        assert tier.drain(10)
        m = tier.peek("s")
        assert m is not None and len(m.chunks) <= MAX_CHUNKS
        assert tier.load(m) == kv_of(tier, blocks), f"turn {t + 1}"
    assert chunk_files(tier) == m.files
    assert tier.stats.writes == 3 * MAX_CHUNKS and tier.stats.write_failures == 0


def test_chunks_removed_under_a_writer_drop_its_write_and_the_next_is_whole(
    tmp_path: Path,
) -> None:
    layout = KVLayout("fp", "uint8", 4, 1, 1, 1)
    tier = SessionTier(layout, tmp_path, BytesCodec(layout))
    tier.publish("s", list(range(1, 10)), [1, 2, 3], 1.0)
    assert tier.drain(10)
    m1 = tier.peek("s")
    assert m1 is not None
    (tier.dir / m1.chunks[0].file).unlink()  # another writer replaced the conversation
    turn2 = list(range(1, 15))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier.publish("s", turn2, [1, 2, 3, 4], 2.0)
        assert tier.drain(10)
    assert tier.stats.write_failures == 1 and any("removed" in str(w.message) for w in caught)
    tier.publish("s", turn2, [1, 2, 3, 4], 3.0)  # the next turn is written whole
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == turn2 and tier.load(m) == kv_of(tier, [1, 2, 3, 4])
