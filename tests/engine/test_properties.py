"""Property test: random arrivals, steps and aborts on a tiny pool never lose or corrupt a block.

The real `Engine` runs (inbox, scheduler, KV manager, block pool, stop checks) with its model
runner replaced by a fake that simulates the KV cache: every slot remembers which token prefix
wrote it. Before each step the fake checks that a sequence's context slots hold its own tokens
(so a prefix hit, a preemption or a reused block never hands it someone else's KV) and that it
writes only to blocks it holds alone. The fake "model" picks the next token from the whole
token history, so a recomputed request must reproduce exactly what it would have said alone.
With speculation on, it verifies draft tokens as the real runner does (each draft kept while it
is the fake model's own choice), and what a rejected draft wrote must never be read as KV.
The fake is also the KV store's codec: a block the pool evicts carries its simulated slots
down to host memory and disk (tiny tiers, so blocks are dropped too) and back into whatever
pool block a later prefix hit promotes it to, where the same checks read it.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shoal.config import EngineConfig
from shoal.engine.llm_engine import Engine
from shoal.engine.output_processor import Sampled
from shoal.engine.scheduler import ScheduledBatch
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.errors import PromptTooLongError
from shoal.sampling_params import SamplingParams

EOS = 2  # the tiny models' eos_token_id
FAKE_VOCAB = 24  # small, so EOS and stop tokens come up often
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 20, 21, 22, 23], [30] * 12]


def prefix_key(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = hash((h, t))
    return h


def fake_next_token(tokens: list[int]) -> int:
    """Half the time the token before last (so outputs repeat, and drafts get kept)."""
    key = prefix_key(tokens)
    return tokens[-2] if len(tokens) > 1 and key % 2 else key % FAKE_VOCAB


class SimulatedKVRunner:
    """Stands in for ModelRunner: checks what a step reads, records what it writes; and for
    the store's `BlockCodec`: a block's bytes are its slots' prefix keys."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> key of the prefix
        self.num_steps = 0
        self.block_nbytes = engine.kv.store.codec.block_nbytes  # type: ignore[union-attr]
        assert self.block_nbytes >= 16 * engine.pool.block_size

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        out = []
        for b in block_ids:
            cells = [self.slots.get((b, i)) for i in range(self.engine.pool.block_size)]
            packed = array("q", [x for c in cells for x in ((0, 0) if c is None else (1, c))])
            out.append(packed.tobytes().ljust(self.block_nbytes, b"\0"))
        return out

    def write_blocks(self, block_ids: list[int], payloads: list[Any]) -> None:
        bs = self.engine.pool.block_size
        for b, payload in zip(block_ids, payloads, strict=True):
            cells = array("q", bytes(payload)[: 16 * bs])
            for i in range(bs):
                if cells[2 * i]:
                    self.slots[(b, i)] = cells[2 * i + 1]
                else:
                    self.slots.pop((b, i), None)

    def copy_block(self, src: int, dst: int) -> None:
        self.write_blocks([dst], self.read_blocks([src]))

    def weight_bytes(self) -> dict[str, int]:
        return {}  # no model behind the simulation

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], Sampled]:
        pool = self.engine.pool
        bs = pool.block_size
        self.num_steps += 1
        assert batch.num_tokens <= self.engine.config.max_num_batched_tokens
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        written: set[tuple[int, int]] = set()
        out_seqs, out_tokens = [], []
        accepted: list[list[int]] = []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            assert n > 0 and seq.status is SequenceStatus.RUNNING
            drafts = seq.draft_token_ids
            assert start + n <= seq.num_tokens + len(drafts)
            assert not drafts or start + 1 + len(drafts) == seq.num_tokens + len(drafts)
            table = seq.block_table
            assert len(table) * bs >= start + n
            tokens = seq.token_ids() + drafts
            key = 0
            for p in range(start + n):
                key = hash((key, tokens[p]))
                slot = (table[p // bs], p % bs)
                if p < start:
                    assert self.slots.get(slot) == key, f"{seq.request_id}: bad KV at {p}"
                else:
                    block = pool.blocks[slot[0]]
                    assert block.ref_cnt == 1, "writing into a shared block"
                    assert block.hash is None, "writing into a published block"
                    assert slot not in written
                    written.add(slot)
                    self.slots[slot] = key
            if drafts:
                choices = [fake_next_token(tokens[: start + 1 + i]) for i in range(n)]
                kept = 0
                while kept < len(drafts) and drafts[kept] == choices[kept]:
                    kept += 1
                out_seqs.append(seq)
                out_tokens.append(choices[kept])
                accepted.append(drafts[:kept])
            elif start + n == seq.num_tokens:
                out_seqs.append(seq)
                out_tokens.append(fake_next_token(tokens))
                accepted.append([])
        return out_seqs, Sampled(out_tokens, None, None, accepted)


def check_pool(engine: Engine) -> None:
    pool = engine.pool
    sched = engine.scheduler
    holders = Counter(b for s in sched.running + sched.waiting for b in s.block_table)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], "ref count != number of holders"
        if block.hash is not None:
            assert pool.lookup(block.hash) == block.block_id
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert pool.num_free == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert seq.status is SequenceStatus.WAITING
    for seq in sched.running:
        assert len(seq.block_table) * pool.block_size >= seq.num_computed_tokens
        assert seq.status is SequenceStatus.RUNNING
        assert len(set(seq.block_table)) == len(seq.block_table)
    assert len(sched.running) <= engine.config.max_num_seqs


def guard_allocate(engine: Engine) -> None:
    """Fail if the pool ever hands out a block that somebody still holds."""
    pool = engine.pool
    original = pool.allocate

    def allocate(n: int) -> list[int]:
        free_before = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        got = original(n)
        assert len(set(got)) == n and set(got) <= free_before, "allocated a pinned block"
        return got

    pool.allocate = allocate  # type: ignore[method-assign]


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = fake_next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t == EOS):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


prompts = st.builds(
    lambda group, cut, tail: (
        ((PREFIXES[group] if group < len(PREFIXES) else []) + tail)[:cut] or [3]
    ),
    st.integers(0, len(PREFIXES)),
    st.integers(1, 16),
    st.lists(st.integers(3, FAKE_VOCAB - 1), max_size=12),
)
requests = st.tuples(
    prompts,
    st.integers(1, 12),  # max_tokens
    st.booleans(),  # ignore_eos
    st.lists(st.integers(0, FAKE_VOCAB - 1), max_size=2),  # stop_token_ids
)
# One round: some arrivals, maybe an abort (of any id, known or not), rarely a reset, then
# a few steps.
rounds = st.lists(
    st.tuples(
        st.lists(requests, max_size=4),
        st.lists(st.integers(0, 30), max_size=1),
        st.integers(0, 19).map(lambda x: x == 0),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=12,
)


@st.composite
def engine_configs(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4]))
    # A pool of 8 to 48 tokens: most requests fit alone, few fit together.
    num_blocks = draw(st.integers(8, 48)) // block_size
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_batched_tokens": draw(st.sampled_from([1, 3, 8, 64])),
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_model_len": draw(st.sampled_from([16, 32, 64])),
        "enable_prefix_caching": draw(st.booleans()),
        "num_speculative_tokens": draw(st.sampled_from([0, 0, 1, 3])),
        "prompt_lookup_min": draw(st.sampled_from([1, 2])),
        "prompt_lookup_max": 2,
        # Host memory and disk of a few blocks (the tiny model's block is a few KiB), or room.
        "host_kv_bytes": draw(st.sampled_from([0, 1 << 14, 1 << 30])),
        "disk_kv_bytes": draw(st.sampled_from([1 << 14, 1 << 30])),
    }


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(config=engine_configs(), ops=rounds)
def test_random_workloads_keep_the_pool_whole(tiny_path: str, config: dict, ops: list) -> None:
    engine = Engine(EngineConfig(model=tiny_path, dtype="float32", batch_wait_s=0.0, **config))
    engine.runner = SimulatedKVRunner(engine)  # type: ignore[assignment]
    engine.kv.store.codec = engine.runner  # type: ignore[union-attr]
    guard_allocate(engine)
    block_size, num_blocks = config["block_size"], config["num_blocks"]
    max_len = engine.max_model_len
    submitted: dict[str, tuple[list[int], SamplingParams]] = {}
    final: dict[str, Any] = {}

    def collect(outputs: list) -> None:
        for out in outputs:
            assert out.request_id in submitted
            if out.finished:
                assert out.request_id not in final, "finished twice"
                final[out.request_id] = out

    def step() -> None:
        collect(engine.step())
        check_pool(engine)

    for arrivals, aborts, reset, num_steps in ops:
        for prompt, max_tokens, ignore_eos, stop_ids in arrivals:
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids
            )
            longest = min(len(prompt) + max_tokens, max_len)
            fits = len(prompt) < max_len and -(-longest // block_size) <= num_blocks
            rid = f"r{len(submitted)}"
            if fits:
                assert engine.add_request(prompt, params, request_id=rid) == rid
                submitted[rid] = (prompt, params)
            else:
                with pytest.raises(PromptTooLongError):
                    engine.add_request(prompt, params, request_id=rid)
        for i in aborts:
            engine.abort(f"r{i}")  # unknown, future or finished ids are ignored
        if reset:
            collect(engine.reset())
            check_pool(engine)
            assert engine.pool.num_free == num_blocks
        for _ in range(num_steps):
            step()

    # Every request finishes: nothing deadlocks, nothing that fits alone is failed.
    budget = 50 + sum(len(p) + sp.max_tokens for p, sp in submitted.values()) * 4
    for _ in range(budget):
        if not engine.has_unfinished_requests():
            break
        step()
    else:
        pytest.fail("requests never finished")
    collect(engine.step())  # aborts queued after the last step
    assert set(final) == set(submitted)
    for rid, out in final.items():
        prompt, params = submitted[rid]
        ref = reference_output(prompt, params, max_len)
        if out.finish_reason == "abort":
            assert out.token_ids == ref[: len(out.token_ids)]
        else:
            assert out.token_ids == ref, rid
            last = ref[-1]
            stopped = last in params.stop_token_ids or (not params.ignore_eos and last == EOS)
            assert out.finish_reason == ("stop" if stopped else "length")
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    stats = engine.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hit_rate > 0}")
    event(f"promoted from host: {stats.kv_host_promotions > 0}")
    event(f"promoted from disk: {stats.kv_disk_promotions > 0}")
    event(f"aborted: {any(o.finish_reason == 'abort' for o in final.values())}")
    event(f"drafts kept: {stats.spec_accepted_tokens > 0}")
    event(f"drafts rejected: {stats.spec_draft_tokens > stats.spec_accepted_tokens}")
    event(f"requests: {min(len(submitted), 5)}+")
    assert stats.num_running == stats.num_waiting == 0 and stats.blocks_used == 0
