"""Salted block hashes (`hashing.Salt`), torch-free: a salt changes every block hash from where
it enters the chain on (and none before), and under random schedules no request ever reads KV
that a request with another salt computed, through the pool, host memory and disk, with
sessions and a declared shared prefix, which every salt does reuse.
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
from shoal.engine.hashing import Salt, chain_hashes, root_hash, session_hashes
from shoal.engine.host_tier import Payload
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence
from shoal.sampling_params import SamplingParams

BS = 4
ROOT = root_hash("fake:int64:4")
SHARED = [7, 8, 9, 10, 11, 12, 13, 14]  # two blocks an operator declared shareable
SALTS = [None, Salt.of("tenant-a"), Salt.of("tenant-b")]
tokens = st.lists(st.integers(0, 50), min_size=0, max_size=40)


@given(tokens, st.integers(0, 12), st.text(min_size=1, max_size=8))
def test_a_salt_changes_the_chain_from_where_it_enters(
    toks: list[int], shared: int, text: str
) -> None:
    salt = Salt.of(text, shared)
    plain = chain_hashes(ROOT, toks, BS)
    salted = chain_hashes(ROOT, toks, BS, salt=salt)
    assert len(salted) == len(plain)
    assert salted[:shared] == plain[:shared]
    assert not set(salted[shared:]) & set(plain)
    other = chain_hashes(ROOT, toks, BS, salt=Salt.of(text + "!", shared))
    assert not set(other[shared:]) & set(salted)


@given(tokens, st.integers(0, 40), st.integers(0, 12))
def test_extending_a_known_salted_chain_gives_the_whole_chain(
    toks: list[int], cut: int, shared: int
) -> None:
    salt = Salt.of("t", shared)
    known = chain_hashes(ROOT, toks[:cut], BS, salt=salt)
    assert chain_hashes(ROOT, toks, BS, known, salt) == chain_hashes(ROOT, toks, BS, salt=salt)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=23), st.integers(0, 6))
def test_a_sessions_partial_block_is_salted_unless_inside_the_shared_prefix(
    toks: list[int], shared: int
) -> None:
    salt = Salt.of("t", shared)
    plain, salted = session_hashes(ROOT, toks, BS), session_hashes(ROOT, toks, BS, salt=salt)
    full = len(toks) // BS
    assert salted[: min(shared, full)] == plain[: min(shared, full)]
    assert not set(salted[min(shared, full) :]) & set(plain)


def test_salts_are_stable_and_tell_texts_apart() -> None:
    assert Salt.of("acme") == Salt.of("acme")  # restarts and replicas agree
    assert Salt.of("acme").key != Salt.of("acme ").key
    assert Salt.of("acme", 2) != Salt.of("acme")


@dataclass
class TaggedCodec:
    """`BlockCodec` over slots that remember (writer's salt index, token): a block read back
    from host memory or disk shows whose KV it is."""

    content: dict[int, list[tuple[int, int] | None]] = field(default_factory=dict)
    block_nbytes: int = BS * 16

    def slots(self, block_ids: list[int], n: int) -> list[tuple[int, int] | None]:
        return [self.content.get(block_ids[p // BS], [None] * BS)[p % BS] for p in range(n)]

    def copy_block(self, src: int, dst: int) -> None:
        self.content[dst] = list(self.content.get(src, [None] * BS))

    def read_blocks(self, block_ids: list[int]) -> list[Payload]:
        out = []
        for b in block_ids:
            flat = [x for s in self.content.get(b, [None] * BS) for x in (s or (-1, -1))]
            out.append(array("q", flat).tobytes())
        return out

    def write_blocks(self, block_ids: list[int], payloads: list[Payload]) -> None:
        for b, p in zip(block_ids, payloads, strict=True):
            flat = list(array("q", bytes(p)))
            pairs = zip(flat[::2], flat[1::2], strict=True)
            self.content[b] = [None if t < 0 else (w, t) for w, t in pairs]


class World:
    def __init__(self, num_blocks: int, host_blocks: int) -> None:
        config = EngineConfig(
            block_size=BS, max_num_batched_tokens=16, max_num_seqs=3, batch_wait_s=0.0
        )
        self.pool = BlockPool(num_blocks, BS)
        self.io = TaggedCodec()
        self.store, self.sessions = build_store(
            KVLayout("fake", "int64", BS, 1, 1, 1),
            self.pool,
            self.io,
            cache_dir=None,
            host_kv_bytes=host_blocks * BS * 16,
            disk_kv_bytes=1 << 20,
        )
        self.kv = KVCacheManager(self.pool, self.sessions.root, True, self.sessions)
        self.sched = Scheduler(config, self.kv, 10_000)
        self.seqs: list[Sequence] = []
        self.tag: dict[int, int] = {}  # id(seq) -> its salt's index
        self.shared_reads = 0  # slots of the shared prefix read from another salt's request

    def add(self, who: int, session: str | None, shared: bool, tail: list[int]) -> None:
        prompt = (SHARED if shared else []) + tail
        salt = SALTS[who]
        if salt is not None and shared:  # as the server declares it: the prefix's full blocks
            salt = Salt(salt.key, len(SHARED) // BS)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        seq = Sequence(f"r{len(self.seqs)}", prompt, params, session_id=session, salt=salt)
        if self.kv.blocks_needed(len(prompt) + 3) > self.pool.num_blocks:
            return
        self.tag[id(seq)] = who
        self.seqs.append(seq)
        self.sched.add(seq)

    def step(self) -> None:
        batch = self.sched.schedule()
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            who = self.tag[id(seq)]
            # the declared prefix's blocks are anyone's (an unsalted request's too)
            shared_blocks = len(SHARED) // BS if seq.prompt_token_ids[:8] == SHARED else 0
            for p, slot in enumerate(self.io.slots(seq.block_table, start)):
                assert slot is not None and slot[1] == seq.token_at(p), "another prompt's KV"
                if p // BS >= shared_blocks and slot[0] != who:
                    # only an unsalted request may read an unsalted request's KV, and a salted
                    # one only its own salt's (the shared prefix aside)
                    raise AssertionError(f"salt {who} read KV of salt {slot[0]} at {p}")
                self.shared_reads += slot[0] != who
            for p in range(start, start + n):
                block = seq.block_table[p // BS]
                self.io.content.setdefault(block, [None] * BS)[p % BS] = (who, seq.token_at(p))
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            if start + n == seq.num_tokens:
                seq.output_token_ids.append((sum(seq.token_ids()) * 7) % 40 + 60)
            self.kv.commit(seq)
        for seq in list(batch.seqs):
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")

    def churn(self) -> None:
        """Other traffic takes every block: cached ones go down to host memory and disk."""
        self.sessions.make_room(self.pool.num_blocks)
        taken = self.pool.allocate(self.pool.num_free)
        for b in taken:
            self.io.content.pop(b, None)
        self.pool.free(taken)


TAILS = [  # agreeing on a block and a half: a session's partly filled block comes into play
    [20, 21, 22, 23, 24, 25],
    [20, 21, 22, 23, 24, 25, 31],
    [20, 21, 22, 23, 30],
    [40, 41, 42, 43, 44, 45, 46, 47, 48],
]
op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, 2),  # who: unsalted, tenant a, tenant b
        st.sampled_from([None, "s1", "s2"]),  # sessions any salt may name (cache_salt varies)
        st.booleans(),
        st.sampled_from(TAILS),
    ),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("churn")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=10, max_size=60), st.integers(8, 24), st.sampled_from([0, 4, 64]))
def test_no_request_reads_kv_another_salt_computed(
    ops: list[tuple], num_blocks: int, host_blocks: int
) -> None:
    w = World(num_blocks, host_blocks)
    for o in ops:
        if o[0] == "add":
            w.add(o[1], o[2], o[3], o[4])
        elif o[0] == "step":
            for _ in range(o[1]):
                w.step()
        else:
            w.churn()
    for _ in range(1000):
        if not len(w.sched):
            break
        w.step()
    assert all(s.is_finished for s in w.seqs)
    event(f"another salt's shared prefix reused: {w.shared_reads > 0}")


def test_the_same_prompt_hits_only_under_its_own_salt() -> None:
    w = World(num_blocks=32, host_blocks=64)
    tail = [20, 21, 22, 23, 24, 25, 26, 27, 28]

    def run(who: int, shared: bool = False) -> int:
        w.add(who, None, shared, tail)
        seq = w.seqs[-1]
        while not seq.is_finished:
            w.step()
        return seq.num_cached_tokens

    assert run(1) == 0
    assert run(2) == 0  # tenant b after tenant a: nothing
    assert run(0) == 0  # nor an unsalted request
    assert run(1) == 8  # tenant a again: its two full prompt blocks
    w.churn()  # down to host memory: still only a's
    assert run(2) == 8 and run(1) == 8
    assert run(1, shared=True) == 0
    assert run(2, shared=True) == len(SHARED)  # the declared prefix, and no more
