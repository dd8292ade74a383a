"""The KV store in tiers: a conversation resent whole with no session finds its KV in any tier
(also after a restart), sessions sharing a prefix store it once, the tiers stay in their
bounds and evict unpinned blocks first, and a damaged block file is never used."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal import Engine, SamplingParams
from shoal.engine.block_files import HEADER, BlockFiles
from shoal.engine.block_pool import BlockPool
from shoal.engine.block_store import BlockStore
from shoal.engine.disk_tier import DiskTier
from shoal.engine.host_tier import HostTier
from shoal.engine.pins import Pins
from shoal.errors import CacheCorruptionError

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(model: Path, **kw: Any) -> Engine:
    kw.setdefault("num_blocks", 256)
    return Engine(model=str(model), dtype="float64", block_size=BLOCK, batch_wait_s=0.0, **kw)


def run(engine: Engine, prompts: list[list[int]], sids: list[str | None] | None = None) -> list:
    sids = sids or [None] * len(prompts)
    ids = [engine.add_request(p, GREEDY, session_id=s) for p, s in zip(prompts, sids, strict=True)]
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


def test_a_full_resend_without_a_session_is_served_from_any_tier(
    model: Path, tmp_path: Path
) -> None:
    """Codex-style turns: the whole conversation each time, no session id; turn 2 hits the
    pool, turn 3 (after other traffic took the pool) host memory, turn 4 (after a restart)
    the disk. Outputs equal a run with no cache at all."""
    reference = make_engine(model, enable_prefix_caching=False)
    engine = make_engine(model, num_blocks=24, cache_dir=str(tmp_path))
    history = list(range(10, 40))
    expected, got = [], []
    for t, (tier, eng) in enumerate([("pool", engine), ("host", engine), ("disk", None)]):
        if tier == "host":  # other traffic fills the pool: the conversation's blocks go down
            run(engine, [list(range(100, 180))])
        if tier == "disk":
            engine.close()
            eng = make_engine(model, num_blocks=24, cache_dir=str(tmp_path))
        assert eng is not None
        history = [*history, 50 + t, 60 + t]
        (ref,) = run(reference, [history])
        (out,) = run(eng, [history])
        expected.append(ref.token_ids)
        got.append(out.token_ids)
        if t:
            assert out.num_cached_tokens >= (len(history) - 8) // BLOCK * BLOCK, tier
        stats = eng.stats()
        if tier == "host":
            assert stats.kv_host_promotions > 0
        if tier == "disk":
            assert stats.kv_disk_promotions > 0 and stats.kv_host_blocks > 0
        history = history + out.token_ids
        engine = eng
    assert got == expected


def test_a_closed_engine_that_read_from_disk_is_freed(model: Path, tmp_path: Path) -> None:
    """A restart in the same process (a server reloading, a benchmark) must not keep the old
    engine's model, pool and host memory: the disk prefetch thread ends when it has read."""
    first = make_engine(model, cache_dir=str(tmp_path))
    run(first, [list(range(10, 50))])
    first.close()
    second = make_engine(model, cache_dir=str(tmp_path))
    (out,) = run(second, [list(range(10, 54))])  # read from disk, ahead of admission
    assert second.stats().kv_disk_promotions > 0
    runner = weakref.ref(second.runner)
    second.close()
    del second, out
    for t in threading.enumerate():
        if t.name == "shoal-kv-prefetch":
            t.join(timeout=60)  # a bound, not a wait for speed: it ends once its queue is read
    gc.collect()
    assert runner() is None


def test_sessions_sharing_a_prefix_store_it_once(model: Path, tmp_path: Path) -> None:
    system = list(range(3, 3 + 40))  # 10 blocks every session shares
    engine = make_engine(model, cache_dir=str(tmp_path))
    prompts = [[*system, 200 + i, 201 + i, 202] for i in range(16)]
    run(engine, prompts, [f"agent-{i}" for i in range(16)])
    assert engine.save_sessions() == 16
    files = list(tmp_path.rglob("*.kv"))
    own = 16 * 2  # each session: the block it fills with its own tokens, and a partial one
    assert len(files) == 10 + own
    block_bytes = files[0].stat().st_size
    assert sum(f.stat().st_size for f in files) == (10 + own) * block_bytes
    assert engine.stats().kv_disk_bytes == (10 + own) * block_bytes


def test_host_tier_stays_in_its_bound_and_evicts_unpinned_first() -> None:
    pins = Pins()
    host = HostTier(cap_bytes=3 * 8, pins=pins)
    pins.pin("session:a", [b"a"])
    assert host.put([(b"a", b"A" * 8), (b"b", b"B" * 8), (b"c", b"C" * 8)]) == []
    out = host.put([(b"d", b"D" * 8)])
    assert [h for h, _ in out] == [b"b"]  # "a" is older but pinned
    assert host.stored_bytes == 24 and b"a" in host
    pins.unpin("session:a")
    assert [h for h, _ in host.put([(b"e", b"E" * 8)])] == [b"a"]


def test_pins_expire() -> None:
    now = [100.0]
    pins = Pins(clock=lambda: now[0])
    pins.pin("bp:x", [b"x"], ttl_s=300)
    assert pins.pinned(b"x") and pins.expire() == []
    now[0] += 301
    assert pins.expire() == ["bp:x"] and not pins.pinned(b"x")


def test_disk_tier_rebuilds_its_index_and_drops_damaged_blocks(tmp_path: Path) -> None:
    pins = Pins()
    disk = DiskTier(tmp_path, 16, cap_bytes=1 << 20, pins=pins)
    blocks = {bytes([i]) * 16: bytes([i]) * 16 for i in range(4)}
    disk.put(list(blocks.items()))
    assert disk.flush()
    again = DiskTier(tmp_path, 16, cap_bytes=1 << 20, pins=pins)
    assert sorted(again.hashes()) == sorted(blocks)
    h = bytes([2]) * 16
    path = again.files.path(h)
    data = bytearray(path.read_bytes())
    data[HEADER.size + 3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum"):
        assert again.get(h) is None
    assert h not in again and not path.exists()
    assert again.get(bytes([1]) * 16) == blocks[bytes([1]) * 16]


def test_disk_tier_evicts_to_its_cap_and_gives_up_the_oldest_pin_last(tmp_path: Path) -> None:
    pins = Pins()
    size = HEADER.size + 16
    disk = DiskTier(tmp_path, 16, cap_bytes=2 * size, pins=pins)
    pins.pin("session:old", [b"p" * 16])
    disk.put([(b"p" * 16, b"P" * 16), (b"u" * 16, b"U" * 16), (b"v" * 16, b"V" * 16)])
    assert disk.flush()
    assert sorted(disk.hashes()) == [b"p" * 16, b"v" * 16]  # the unpinned "u" went first
    pins.pin("session:new", [b"v" * 16])
    pins.pin("session:newer", [b"w" * 16])
    disk.put([(b"w" * 16, b"W" * 16)])
    assert disk.flush()
    assert disk.take_unpinned() == ["session:old"]  # only pins left: the oldest is given up
    assert sorted(disk.hashes()) == [b"v" * 16, b"w" * 16]


def test_a_write_back_larger_than_the_queue_is_written_not_stuck(tmp_path: Path) -> None:
    """Saving sessions at shutdown puts every pinned block in one call (`wait=True`): more than
    the queue holds must wait for the writer, so the writer must be running while it waits."""
    size = HEADER.size + 16
    disk = DiskTier(tmp_path, 16, cap_bytes=1 << 20, pins=Pins(), max_pending_bytes=2 * size)
    blocks = [(bytes([i]) * 16, bytes([i]) * 16) for i in range(12)]
    putter = threading.Thread(target=disk.put, args=(blocks,), kwargs={"wait": True}, daemon=True)
    putter.start()
    putter.join(timeout=60)  # a liveness bound: it returns as soon as ten blocks are written
    assert not putter.is_alive(), "put(wait=True) waited for a writer that was never started"
    assert disk.flush()
    assert sorted(disk.hashes()) == sorted(h for h, _ in blocks) and disk.dropped == 0


class CountingCodec:
    """A `BlockCodec` of 16-byte blocks that remembers how many it copied out at once."""

    block_nbytes = 16

    def __init__(self) -> None:
        self.largest_read = 0

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        self.largest_read = max(self.largest_read, len(block_ids))
        return [bytes([b]) * 16 for b in block_ids]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        raise AssertionError("a write-back only reads")

    def copy_block(self, src: int, dst: int) -> None:
        raise AssertionError("a write-back only reads")


def test_a_write_back_copies_the_pool_a_queue_at_a_time(tmp_path: Path) -> None:
    """Closing an engine puts its whole pool on disk; a copy of the whole pool at once would
    cost its size again in host memory, so it goes a queue's worth at a time."""
    pool = BlockPool(40, BLOCK)
    for b in pool.allocate(40):
        pool.cache(b, bytes([b]) * 16)
    size = HEADER.size + 16
    pins = Pins()
    disk = DiskTier(tmp_path, 16, cap_bytes=1 << 20, pins=pins, max_pending_bytes=4 * size)
    codec = CountingCodec()
    store = BlockStore(pool, codec, HostTier(0, pins), disk)
    assert store.write_back() == 40
    assert len(disk) == 40 and codec.largest_read <= 4


def test_block_files_refuse_another_blocks_file(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, 8)
    files.write(b"a" * 16, b"12345678", durable=True)
    files.path(b"b" * 16).parent.mkdir(exist_ok=True)
    files.path(b"a" * 16).rename(files.path(b"b" * 16))
    with pytest.raises(CacheCorruptionError, match="another block"):
        files.read(b"b" * 16)
    with pytest.raises(ValueError):
        files.write(b"c" * 16, b"short", durable=False)
