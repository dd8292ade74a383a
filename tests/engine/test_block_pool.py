"""BlockPool, chained block hashes and KVCacheManager: pure Python, no model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.engine.block_pool import BlockPool
from shoal.engine.hashing import block_hash, chain_hashes, root_hash
from shoal.engine.kv_cache_manager import KVCacheManager, PrefixHit
from shoal.engine.sequence import Sequence
from shoal.errors import PoolExhaustedError
from shoal.sampling_params import SamplingParams

ROOT = root_hash("test-model:float32")


# -- BlockPool ---------------------------------------------------------------------------
def test_new_pool_is_all_free():
    pool = BlockPool(5, 4)
    assert pool.num_free == 5 and pool.num_used == 0
    assert [b.ref_cnt for b in pool.blocks] == [0] * 5


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError):
        BlockPool(n, 16)


def test_allocate_pins_and_exhaustion_is_typed_and_harmless():
    pool = BlockPool(4, 2)
    got = pool.allocate(3)
    assert len(set(got)) == 3
    assert all(pool.blocks[b].ref_cnt == 1 for b in got)
    assert pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    (last,) = pool.allocate(1)
    assert last not in got
    assert pool.allocate(0) == []
    pool.free([*got, last])
    assert pool.num_free == 4


def test_double_free_is_caught():
    pool = BlockPool(2, 2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])
    assert pool.num_free == 2


def test_scratch_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, 2)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"h-a")
    pool.cache(b, b"h-b")
    pool.free([a, b, c, d])
    # Cached blocks wait at the tail in the order freed; scratch blocks jump to the head.
    order = pool.allocate(4)
    assert set(order[:2]) == {c, d}
    assert order[2:] == [a, b]
    assert pool.lookup(b"h-a") is None and pool.lookup(b"h-b") is None
    assert pool.blocks[a].hash is None


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"1"), (b, b"2"), (c, b"3")):
        pool.cache(blk, h)
    pool.free([b])
    pool.free([c])
    pool.free([a])
    (first,) = pool.allocate(1)
    assert first == b
    assert pool.lookup(b"2") is None
    assert pool.lookup(b"3") == c and pool.lookup(b"1") == a


def test_touch_revives_an_idle_cached_block_and_pins_it():
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"x")
    pool.free([a, b, c])
    assert pool.num_free == 3
    assert pool.lookup(b"x") == a
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 1
    assert pool.num_free == 2
    # A pinned block is never handed out, even when everything else is taken.
    got = pool.allocate(2)
    assert a not in got
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)
    pool.touch([a])  # a second holder
    assert pool.blocks[a].ref_cnt == 2
    pool.free([a])
    assert pool.blocks[a].ref_cnt == 1 and pool.num_free == 0
    pool.free([a])
    assert pool.num_free == 1 and pool.lookup(b"x") == a  # idle but still cached
    pool.free(got)


def test_cache_first_writer_wins():
    pool = BlockPool(3, 2)
    a, b, _ = pool.allocate(3)
    pool.cache(a, b"same")
    pool.cache(b, b"same")
    assert pool.lookup(b"same") == a
    assert pool.blocks[b].hash is None
    pool.cache(a, b"other")  # a block keeps its first hash
    assert pool.lookup(b"other") is None and pool.blocks[a].hash == b"same"


def test_evict_cached_forgets_only_idle_blocks():
    pool = BlockPool(3, 2)
    a, b, _c = pool.allocate(3)
    pool.cache(a, b"idle")
    pool.cache(b, b"held")
    pool.free([a])
    pool.evict_cached()
    assert pool.lookup(b"idle") is None and pool.blocks[a].hash is None
    assert pool.lookup(b"held") == b


# -- hashing -----------------------------------------------------------------------------
def test_chain_hashes_cover_full_blocks_only_and_chain():
    tokens = list(range(10))
    hashes = chain_hashes(ROOT, tokens, 4)
    assert len(hashes) == 2  # 10 tokens: two full blocks, the partial third is not hashed
    assert hashes[0] == block_hash(ROOT, tokens[:4])
    assert hashes[1] == block_hash(hashes[0], tokens[4:8])
    # A change in block 0 changes every later hash; a change in block 1 leaves block 0 alone.
    changed0 = chain_hashes(ROOT, [99, *tokens[1:]], 4)
    assert changed0[0] != hashes[0] and changed0[1] != hashes[1]
    changed1 = chain_hashes(ROOT, [*tokens[:5], 99, *tokens[6:]], 4)
    assert changed1[0] == hashes[0] and changed1[1] != hashes[1]
    # The same tokens after a different prefix hash differently.
    assert chain_hashes(ROOT, [7, 7, 7, 7, 0, 1, 2, 3], 4)[1] != block_hash(ROOT, [0, 1, 2, 3])


def test_chain_hashes_extend_a_known_prefix():
    tokens = list(range(3, 40))
    full = chain_hashes(ROOT, tokens, 4)
    assert chain_hashes(ROOT, tokens, 4, full[:3]) == full
    assert chain_hashes(ROOT, tokens[:17], 4) == full[:4]


def test_root_depends_on_the_model_fingerprint():
    assert root_hash("a") == root_hash("a")
    assert root_hash("a") != root_hash("b")
    assert chain_hashes(root_hash("a"), [1, 2], 2) != chain_hashes(root_hash("b"), [1, 2], 2)


def test_hashes_are_stable_across_processes():
    """A hash must mean the same KV after a restart: no per-process salt (PYTHONHASHSEED)."""
    path = Path(importlib.util.find_spec("shoal.engine.hashing").origin)  # type: ignore[union-attr, arg-type]
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('h', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['h'] = m\n"
        "spec.loader.exec_module(m)\n"
        "print(m.chain_hashes(m.root_hash('fp'), list(range(12)), 4)[-1].hex())\n"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(proc.stdout.strip())
    assert outs == {chain_hashes(root_hash("fp"), list(range(12)), 4)[-1].hex()}


# -- KVCacheManager ----------------------------------------------------------------------
def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def run_prefill(kv: KVCacheManager, seq: Sequence) -> None:
    """Admit `seq` with whatever prefix hits, compute the rest and publish full blocks."""
    hits = kv.find_cached_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - len(hits) * kv.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)


def test_prefix_hits_share_blocks_and_never_cover_the_last_token():
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool, ROOT)
    a = make_seq(list(range(12)), "a")
    run_prefill(kv, a)
    assert len(a.block_table) == 3
    # The same 12 tokens: only 2 blocks may hit, the last token is computed again.
    b = make_seq(list(range(12)), "b")
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    # A longer prompt hits all three.
    c = make_seq(list(range(14)), "c")
    assert kv.find_cached_prefix(c) == a.block_table
    # A different first token hits nothing.
    d = make_seq([99, *range(1, 14)], "d")
    assert kv.find_cached_prefix(d) == []
    # Joining: hit blocks are shared (ref counts), the rest are fresh.
    assert kv.allocate(c, 2, kv.find_cached_prefix(c))
    assert c.block_table[:3] == a.block_table and len(c.block_table) == 4
    assert c.num_computed_tokens == 12
    assert [pool.blocks[x].ref_cnt for x in a.block_table] == [2, 2, 2]
    kv.free(a)
    kv.free(c)
    assert pool.num_free == 16
    assert a.block_table == [] and a.num_computed_tokens == 0


def test_hits_survive_their_owner_and_revive_from_the_free_queue():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool, ROOT)
    a = make_seq(list(range(9)), "a")
    run_prefill(kv, a)
    blocks = list(a.block_table)
    kv.free(a)
    assert pool.num_free == 8
    b = make_seq(list(range(10)), "b")
    hits = kv.find_cached_prefix(b)
    assert hits == blocks[:2]
    assert kv.allocate(b, 2, hits)
    assert pool.num_free == 8 - 3


def test_allocate_counts_idle_hits_against_free_blocks_and_fails_cleanly():
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool, ROOT)
    a = make_seq(list(range(8)), "a")
    run_prefill(kv, a)
    kv.free(a)  # both blocks idle but cached
    b = make_seq(list(range(20)), "b")
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    # 20 tokens need 5 blocks; the pool has 4: nothing may change on failure.
    assert not kv.allocate(b, 12, hits)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert pool.num_free == 4 and all(x.ref_cnt == 0 for x in pool.blocks)
    assert kv.allocate(b, 8, hits)  # 16 tokens: 2 hits + 2 new blocks
    assert pool.num_free == 0


def test_prefix_caching_disabled():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool, ROOT, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    run_prefill(kv, a)
    assert all(x.hash is None for x in pool.blocks)
    assert kv.find_cached_prefix(make_seq(list(range(12)))) == []


def test_freeing_a_table_evicts_its_tail_first():
    """Blocks of a table are freed tail-first, so the start of a prefix outlives its end."""
    pool = BlockPool(4, 2)
    kv = KVCacheManager(pool, ROOT)
    a = make_seq(list(range(8)), "a")
    run_prefill(kv, a)
    table = list(a.block_table)  # free() empties the sequence's own list
    kv.free(a)
    assert pool.allocate(2) == [table[3], table[2]]
    b = make_seq([*range(5), 50], "b")
    assert kv.find_cached_prefix(b) == table[:2]


def test_commit_publishes_only_computed_full_blocks():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool, ROOT)
    a = make_seq(list(range(11)), "a")
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 6  # a first chunk: one full block computed
    kv.commit(a)
    assert a.num_committed_blocks == 1
    assert pool.blocks[a.block_table[0]].hash is not None
    assert pool.blocks[a.block_table[1]].hash is None
    assert kv.allocate(a, 5)
    a.num_computed_tokens = 11
    kv.commit(a)
    assert a.num_committed_blocks == 2
    assert pool.blocks[a.block_table[2]].hash is None  # 3 tokens: partial, unpublished
    # Decoding fills the third block; once computed it is published too.
    a.output_token_ids.append(7)
    assert kv.allocate(a, 1)
    a.num_computed_tokens = 12
    kv.commit(a)
    assert pool.blocks[a.block_table[2]].hash == chain_hashes(ROOT, a.token_ids(), 4)[2]


def test_prefix_hit_rate_accounting():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool, ROOT)
    assert kv.prefix_stats.hit_rate == 0.0
    for hit in (0, 8):
        seq = make_seq(list(range(10)))
        seq.num_computed_tokens = hit
        kv.admitted(seq, PrefixHit())
    assert kv.prefix_stats.hit_rate == pytest.approx(8 / 20)
