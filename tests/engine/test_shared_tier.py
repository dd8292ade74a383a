"""The shared folder of the KV store: a session moves between engines sharing it and is
restored there, not recomputed; a turn whose copy has landed before a kill -9 is lost to no
one; damaged or older copies are never used; a turn writes only the blocks the folder lacks.
Outputs equal a no-cache run's."""

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
from shoal.engine.block_files import KVLayout
from shoal.engine.hashing import root_hash, session_hashes
from shoal.engine.session_manifests import manifest_name
from shoal.engine.shared_tier import SharedTier

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
    assert not list((tmp_path / "tier").glob("*/sessions/*.json"))  # drop forgets it there too


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
engine.sessions.shared.drain()  # the write-behind copy has landed (its lag is on /metrics)
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
    (manifest,) = tier.glob("*/sessions/*.json")
    m = json.loads(manifest.read_text())
    root = root_hash(f"{m['fingerprint']}:{m['dtype']}:{m['block_size']}")
    first = session_hashes(root, m["token_ids"], 4)[0].hex()
    block = manifest.parents[1] / "blocks" / first[:2] / f"{first}.kv"
    data = bytearray(block.read_bytes())
    data[-3] ^= 0xFF
    block.write_bytes(bytes(data))
    b = make_engine(model, session_tier_dir=str(tier))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, cached = turn(b, conv[1][0], "s")
    assert out == conv[1][1] and cached == 0
    assert any("checksum" in str(w.message) for w in caught)
    assert block.exists()  # a reader never deletes what may be another writer's


LAYOUT = KVLayout("fp", "uint8", 4, 1, 1, 1)
ROOT = root_hash(LAYOUT.root())


class BytesCodec:
    """Pool block `b`'s KV is two bytes of value `b`: enough to test what the files hold."""

    block_nbytes = 2

    def __init__(self) -> None:
        self.copied: list[int] = []

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        self.copied += block_ids
        return [bytes([b % 256]) * 2 for b in block_ids]


def blocks_of(tokens: list[int], block_ids: list[int]) -> dict[bytes, int]:
    return dict(zip(session_hashes(ROOT, tokens, 4), block_ids, strict=True))


def kv(tier: SharedTier, tokens: list[int]) -> list[int]:
    """What the folder holds for `tokens`' blocks, as the pool block ids they were copied from."""
    out = []
    for h in session_hashes(ROOT, tokens, 4):
        payload = tier.read(h)
        assert payload is not None
        out.append(payload[0])
    return out


def block_files(tier: SharedTier) -> set[str]:
    return {p.name for p in tier.files.dir.rglob("*.kv")}


def test_an_older_turn_never_replaces_a_later_one(tmp_path: Path) -> None:
    tier = SharedTier(LAYOUT, tmp_path, BytesCodec(), ROOT)
    later = list(range(1, 10))
    tier.publish("s", later, blocks_of(later, [1, 2, 3]), 1.0)
    assert tier.drain(10)
    tier.publish("s", later[:5], blocks_of(later[:5], [1, 2]), 2.0)  # a slow replica's, late
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == later
    assert tier.stats.writes == 1 and tier.stats.superseded == 1
    assert kv(tier, later) == [1, 2, 3]
    other = [1, 2, 3, 4, 99]  # not a prefix: another conversation under the same id replaces it
    tier.publish("s", other, blocks_of(other, [7, 8]), 3.0)
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == other and kv(tier, other) == [1, 8]  # block 0 shared
    manifest = json.loads((tier.sessions_dir / manifest_name("s")).read_text())
    assert manifest["fingerprint"] == "fp"
    tier.delete("s")
    assert tier.peek("s") is None and not list(tier.sessions_dir.iterdir())


def test_a_later_turn_writes_only_its_new_blocks(tmp_path: Path) -> None:
    codec = BytesCodec()
    tier = SharedTier(LAYOUT, tmp_path, codec, ROOT)
    turn1 = list(range(1, 10))  # blocks 0-1 full, block 2 holds one token
    tier.publish("s", turn1, blocks_of(turn1, [11, 12, 13]), 1.0)
    assert tier.drain(10)
    assert codec.copied == [11, 12, 13] and len(block_files(tier)) == 3
    turn2 = [*turn1, 10, 11, 12, 13, 14]  # blocks 0-2 full, block 3 holds two tokens
    tier.publish("s", turn2, blocks_of(turn2, [11, 12, 14, 15]), 2.0)
    assert codec.copied[3:] == [14, 15]  # only the blocks the folder lacks are copied
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == turn2
    other = SharedTier(LAYOUT, tmp_path, BytesCodec(), ROOT)  # another engine reads it whole
    assert kv(other, turn2) == [11, 12, 14, 15]
    for sid in ("a", "b", "c"):  # sessions sharing a prefix store it once
        tokens = [*turn1[:8], ord(sid)]
        tier.publish(sid, tokens, blocks_of(tokens, [11, 12, 20 + ord(sid)]), 3.0)
    assert tier.drain(10)
    assert len(block_files(tier)) == 5 + 3  # turn 1's partial block, swept with time


def test_blocks_removed_under_a_writer_drop_its_write_and_the_next_is_whole(
    tmp_path: Path,
) -> None:
    tier = SharedTier(LAYOUT, tmp_path, BytesCodec(), ROOT)
    turn1 = list(range(1, 10))
    tier.publish("s", turn1, blocks_of(turn1, [1, 2, 3]), 1.0)
    assert tier.drain(10)
    first = session_hashes(ROOT, turn1, 4)[0]
    tier.files.delete(first)  # another writer's sweep took it
    turn2 = list(range(1, 15))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier.publish("s", turn2, blocks_of(turn2, [1, 2, 3, 4]), 2.0)
        assert tier.drain(10)
    assert tier.stats.write_failures == 1 and any("removed" in str(w.message) for w in caught)
    tier.publish("s", turn2, blocks_of(turn2, [1, 2, 3, 4]), 3.0)  # the next turn is whole
    assert tier.drain(10)
    m = tier.peek("s")
    assert m is not None and m.token_ids == turn2 and kv(tier, turn2) == [1, 2, 3, 4]
