"""Sessions under random schedules, torch-free: the scheduler and KV manager drive a fake runner
that records which token each KV slot holds, so any lost, shared-then-overwritten or evicted-
while-pinned block shows up as a slot holding the wrong token.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shoal.config import EngineConfig
from shoal.engine.block_files import KVLayout
from shoal.engine.block_pool import BlockPool
from shoal.engine.block_store import build_store
from shoal.engine.host_tier import Payload
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.sampling_params import SamplingParams

BS = 4
SYSTEM = [7, 8, 9, 10, 11, 12]
SLOT = 8  # bytes a fake KV slot takes: the token id whose KV it holds (-1: nothing)


def next_token(seq: Sequence) -> int:
    return (sum(seq.token_ids()) * 31 + seq.num_tokens) % 97 + 100


@dataclass
class FakeCodec:
    """`BlockCodec` over slot contents: `content[block][i]` is the token whose KV sits there,
    and a block's bytes are those token ids, so a block that comes back from host memory or
    disk shows where it has been."""

    content: dict[int, list[int | None]] = field(default_factory=dict)
    block_nbytes: int = BS * SLOT
    reads: int = 0
    writes: int = 0

    def tokens_in(self, block_ids: list[int], n: int) -> list[int | None]:
        return [self.content.get(block_ids[p // BS], [None] * BS)[p % BS] for p in range(n)]

    def copy_block(self, src: int, dst: int) -> None:
        self.content[dst] = list(self.content.get(src, [None] * BS))

    def read_blocks(self, block_ids: list[int]) -> list[Payload]:
        self.reads += len(block_ids)
        return [
            array("q", [-1 if t is None else t for t in self.content.get(b, [None] * BS)]).tobytes()
            for b in block_ids
        ]

    def write_blocks(self, block_ids: list[int], payloads: list[Payload]) -> None:
        self.writes += len(block_ids)
        for b, p in zip(block_ids, payloads, strict=True):
            self.content[b] = [None if t < 0 else t for t in array("q", bytes(p))]


class World:
    def __init__(
        self,
        num_blocks: int,
        budget: int,
        max_seqs: int,
        prefix: bool,
        host_blocks: int = 64,
        disk_blocks: int = 1 << 10,
    ) -> None:
        self.config = EngineConfig(
            block_size=BS,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            batch_wait_s=0.0,
            enable_prefix_caching=prefix,
            host_kv_bytes=host_blocks * BS * SLOT,
            disk_kv_bytes=disk_blocks * (BS * SLOT + 38),
        )
        self.pool = BlockPool(num_blocks, BS)
        self.io = FakeCodec()
        layout = KVLayout("fake", "int64", BS, 1, 1, 1)
        self.store, self.table = build_store(
            layout,
            self.pool,
            self.io,
            cache_dir=None,
            host_kv_bytes=self.config.host_kv_bytes,
            disk_kv_bytes=self.config.disk_kv_bytes,
        )
        self.kv = KVCacheManager(self.pool, self.table.root, prefix, self.table)
        self.sched = Scheduler(self.config, self.kv, 10_000)
        self.history: dict[str, list[int]] = {}
        self.seqs: list[Sequence] = []
        self.started: list[Sequence] = []

    def churn(self) -> None:
        """Other traffic takes every free block: idle sessions give theirs back, and all the
        pool had cached goes down to host memory (and on to disk)."""
        self.table.make_room(self.pool.num_blocks)
        taken = self.pool.allocate(self.pool.num_free)
        for b in taken:
            self.io.content.pop(b, None)  # overwritten by the other traffic
        self.pool.free(taken)

    def lose(self, sid: str) -> None:
        """The session's first block below the pool is lost (a damaged file, a full disk)."""
        session = self.table.get(sid)
        for h in session.hashes if session is not None else ():
            if self.pool.lookup(h) is None:
                self.store.host.discard(h)
                self.store.disk.flush()
                self.store.disk.delete(h)
                return

    def add(self, sid: str | None, new: list[int], cut: int, max_tokens: int) -> None:
        base = self.history.get(sid, SYSTEM) if sid is not None else SYSTEM
        prompt = base[: max(1, len(base) - cut)] + new
        if self.kv.blocks_needed(len(prompt) + max_tokens) > self.pool.num_blocks:
            return  # the engine rejects it up front
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = Sequence(f"r{len(self.seqs)}", prompt, params, session_id=sid)
        self.seqs.append(seq)
        self.sched.add(seq)

    def check_sessions(self) -> None:
        """Resident session KV is intact, and pinned sessions belong to running requests."""
        running = {s.session_id for s in self.sched.running}
        for s in self.table:
            got = self.io.tokens_in(s.block_ids, len(s.token_ids)) if s.resident else None
            assert got is None or got == s.token_ids
            assert s.running == (s.session_id in running)
            assert all(self.pool.blocks[b].ref_cnt > 0 for b in s.block_ids)

    def step(self) -> None:
        batch = self.sched.schedule()
        sids = [s.session_id for s in self.sched.running if s.session_id is not None]
        assert len(sids) == len(set(sids)), "two requests of one session run together"
        for seq in self.sched.running:
            if seq not in self.started:
                self.started.append(seq)
            for b in seq.block_table:  # pinned: held, never on the free queue
                assert self.pool.blocks[b].ref_cnt > 0
        self.check_sessions()
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            assert self.io.tokens_in(seq.block_table, start) == seq.tokens_slice(0, start)
            for p in range(start, start + n):
                block = seq.block_table[p // BS]
                assert self.pool.blocks[block].ref_cnt == 1, "writing into a shared block"
                self.io.content.setdefault(block, [None] * BS)[p % BS] = seq.token_at(p)
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            if start + n == seq.num_tokens:
                seq.output_token_ids.append(next_token(seq))
            self.kv.commit(seq)
        for seq in list(batch.seqs):
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
                if seq.session_id is not None:
                    self.history[seq.session_id] = seq.token_ids()
        self.check_sessions()

    def abort(self, i: int) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        if live:
            self.sched.finish(live[i % len(live)], "abort")


SESSION_IDS = ["a", "b", "c", None]
add = st.tuples(
    st.just("add"),
    st.sampled_from(SESSION_IDS),
    st.lists(st.integers(20, 60), min_size=1, max_size=7),
    st.integers(0, 6),  # tokens cut from the end of the session's context: a branch
    st.integers(1, 6),
)
op = st.one_of(
    add,
    add,
    add,
    add,
    st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("churn"), st.just(0)),
    st.tuples(st.just("drop"), st.sampled_from(SESSION_IDS[:3])),
    st.tuples(st.just("lose_block"), st.sampled_from(SESSION_IDS[:3])),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=20, max_size=80),
    num_blocks=st.integers(6, 20),
    budget=st.integers(4, 32),
    max_seqs=st.integers(1, 4),
    prefix=st.booleans(),
    host_blocks=st.sampled_from([0, 2, 64]),
    disk_blocks=st.sampled_from([3, 1 << 10]),
)
def test_random_schedules_keep_session_kv_and_pins_intact(
    ops: list[tuple],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    prefix: bool,
    host_blocks: int,
    disk_blocks: int,
) -> None:
    """Sessions' and cached blocks go down to host memory and disk (tiny ones: blocks are
    dropped too) and come back: every step checks that the slots a request reads hold its own
    tokens, so a block promoted with the wrong KV fails at once."""
    w = World(num_blocks, budget, max_seqs, prefix, host_blocks, disk_blocks)
    for o in ops:
        if o[0] == "add":
            w.add(o[1], o[2], o[3], o[4])
        elif o[0] == "step":
            for _ in range(o[1]):
                w.step()
        elif o[0] == "abort":
            w.abort(o[1])
        elif o[0] == "drop":
            w.table.drop(o[1])
        elif o[0] == "churn":
            w.churn()
        else:
            w.lose(o[1])
    for _ in range(2000):  # nothing starves: everything finishes
        if not len(w.sched):
            break
        w.step()
    assert not len(w.sched)
    assert all(s.is_finished for s in w.seqs)
    for sid in "abc":  # within a session, requests start in arrival order
        order = [s for s in w.started if s.session_id == sid]
        assert order == sorted(order, key=lambda s: int(s.request_id[1:]))
    # The pool is whole: only sessions hold blocks, once each.
    held: dict[int, int] = {}
    for s in w.table:
        for b in s.block_ids:
            held[b] = held.get(b, 0) + 1
    assert all(b.ref_cnt == held.get(b.block_id, 0) for b in w.pool.blocks)
    for s in w.table:
        w.table.drop(s.session_id)
    assert w.pool.num_free == w.pool.num_blocks
    for tier in ("host", "disk"):
        event(f"promoted from {tier}: {w.store.stats.tiers[tier].promotions > 0}")


def test_deferral_skips_busy_session_without_breaking_fifo() -> None:
    w = World(num_blocks=64, budget=64, max_seqs=4, prefix=True)
    w.add("a", [21, 22], 0, 3)
    w.add("a", [23], 0, 3)  # deferred behind the first "a"
    w.add("b", [24], 0, 3)  # goes ahead of it
    w.step()
    running = [s.request_id for s in w.sched.running]
    assert running == ["r0", "r2"]
    assert [s.request_id for s in w.sched.waiting] == ["r1"]
    while len(w.sched):
        w.step()
    assert [s.request_id for s in w.started] == ["r0", "r2", "r1"]
    assert w.seqs[1].status is SequenceStatus.FINISHED


def test_running_request_may_spill_its_own_session_rather_than_livelock() -> None:
    """A branch of a long context fills the pool: the session's leftovers go to disk."""
    w = World(num_blocks=8, budget=4, max_seqs=2, prefix=False)
    w.add("a", list(range(20, 30)), 0, 2)  # the session ends up holding 17 tokens, 5 blocks
    while len(w.sched):
        w.step()
    w.add("a", list(range(40, 52)), 5, 4)  # 13 shared tokens + 12 new + 4 out: the whole pool
    assert len(w.seqs) == 2
    for _ in range(50):
        if not len(w.sched):
            break
        w.step()
    assert all(s.is_finished for s in w.seqs)
    assert w.sched.num_preemptions == 0
    assert w.store.stats.tiers["host"].demotions > 0  # the leftovers went to host memory
