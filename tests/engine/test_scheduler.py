"""The token-budget scheduler, driven directly with a fake model (no torch work at all)."""

from __future__ import annotations

import time

import pytest

from shoal.config import EngineConfig
from shoal.engine.block_pool import BlockPool
from shoal.engine.hashing import root_hash
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.scheduler import ScheduledBatch, Scheduler
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.sampling_params import SamplingParams

ROOT = root_hash("fake-model")


def fake_next_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends on every token so far."""
    return (sum(seq.token_ids()) * 7 + seq.num_tokens) % 300 + 3


class Driver:
    """Scheduler + KV manager + a fake runner, doing what `Engine.step` does around them."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 1024,
        enable_prefix_caching: bool = True,
        **config,
    ) -> None:
        config.setdefault("batch_wait_s", 0.0)
        self.config = EngineConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching, **config
        )
        self.pool = BlockPool(num_blocks, block_size)
        self.kv = KVCacheManager(self.pool, ROOT, enable_prefix_caching)
        self.sched = Scheduler(self.config, self.kv, max_model_len)
        self.max_model_len = max_model_len
        self.finished: list[Sequence] = []
        self._num_added = 0

    def add(self, rid: str, prompt: list[int] | int, max_tokens: int = 4, priority: int = 0):
        self._num_added += 1
        if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
            prompt = list(range(1000 * self._num_added, 1000 * self._num_added + prompt))
        tokens = prompt
        seq = Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), priority=priority)
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        assert batch.num_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        done = []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True):
            assert n > 0
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * self.pool.block_size >= start + n
            assert seq.num_computed_tokens == start + n
            if start + n == seq.num_tokens:
                seq.output_token_ids.append(fake_next_token(seq))
                if (
                    seq.num_output_tokens >= seq.params.max_tokens
                    or seq.num_tokens >= self.max_model_len
                ):
                    done.append(seq)
        for seq in batch.seqs:
            self.kv.commit(seq)
        for seq in done:
            self.sched.finish(seq, "length")
            self.finished.append(seq)
        return batch

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while len(self.sched):
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


def plan(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    return [
        (s.request_id, start, n)
        for s, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens, strict=True)
    ]


def reference(seq: Sequence) -> list[int]:
    """What `seq` generates when run alone, start to finish."""
    ref = Sequence("ref", list(seq.prompt_token_ids), SamplingParams())
    for _ in range(seq.params.max_tokens):
        ref.output_token_ids.append(fake_next_token(ref))
    return ref.output_token_ids


def test_one_token_budget_per_step_running_first_then_fifo():
    d = Driver(max_num_batched_tokens=16)
    d.add("a", 10)
    d.add("b", 10)
    d.add("c", 10)
    assert plan(d.step()) == [("a", 0, 10), ("b", 0, 6)]  # b's prompt is chunked
    assert [s.request_id for s in d.sched.waiting] == ["c"]
    # Running requests come first: a decodes, b finishes its prompt, c gets what is left.
    assert plan(d.step()) == [("a", 10, 1), ("b", 6, 4), ("c", 0, 10)]
    assert plan(d.step()) == [("a", 11, 1), ("b", 10, 1), ("c", 10, 1)]
    d.run()
    assert d.pool.num_free == d.pool.num_blocks


def test_long_prompt_is_prefilled_in_chunks_and_samples_once():
    d = Driver(max_num_batched_tokens=16)
    seq = d.add("long", 50, max_tokens=3)
    chunks = []
    while not seq.output_token_ids:
        chunks.append(plan(d.step()))
    assert chunks == [[("long", 0, 16)], [("long", 16, 16)], [("long", 32, 16)], [("long", 48, 2)]]
    assert seq.num_output_tokens == 1
    d.run()
    assert seq.output_token_ids == reference(seq)


def test_chunks_run_beside_decodes():
    d = Driver(max_num_batched_tokens=8)
    d.add("short", 3, max_tokens=10)
    d.step()
    d.add("long", 30)
    assert plan(d.step()) == [("short", 3, 1), ("long", 0, 7)]
    assert plan(d.step()) == [("short", 4, 1), ("long", 7, 7)]


def test_max_num_seqs_caps_the_batch_and_a_finish_makes_room_in_the_same_step():
    d = Driver(max_num_seqs=2)
    a = d.add("a", 5, max_tokens=1)
    d.add("b", 5, max_tokens=3)
    d.add("c", 5, max_tokens=3)
    assert [s for s, _, _ in plan(d.step())] == ["a", "b"]
    assert a.is_finished and a.finish_reason == "length" and a.block_table == []
    assert [s for s, _, _ in plan(d.step())] == ["b", "c"]


def test_finishing_frees_blocks_at_once():
    d = Driver(num_blocks=8, block_size=4)
    seq = d.add("a", 9, max_tokens=2)
    d.step()
    assert d.pool.num_used == 3
    d.step()
    assert seq.is_finished
    assert d.pool.num_used == 0 and d.pool.num_free == 8


def test_waiting_queue_is_fifo_under_memory_pressure():
    """The head of the queue waits for room; a smaller request may not jump ahead of it."""
    d = Driver(num_blocks=6, block_size=4)
    d.add("a", 12, max_tokens=8)  # 3 blocks, up to 5
    d.step()
    d.add("big", 14, max_tokens=1)  # 4 blocks: does not fit next to a
    d.add("small", 2, max_tokens=1)  # 1 block: would fit, must wait its turn
    batch = d.step()
    assert [s for s, _, _ in plan(batch)] == ["a"]
    assert [s.request_id for s in d.sched.waiting] == ["big", "small"]
    d.run()
    order = [s.request_id for s in d.finished]
    assert order.index("big") < order.index("small")


def test_preemption_frees_the_newest_and_requeues_it_at_its_place():
    d = Driver(num_blocks=4, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    a = d.add("a", 4, max_tokens=8)  # grows to 3 blocks
    b = d.add("b", 4, max_tokens=8)
    d.add("c", 1, max_tokens=1)
    d.step()
    assert {s.request_id for s in d.sched.running} == {"a", "b"}
    assert d.sched.waiting[0].request_id == "c"
    preempted = []
    while not preempted:
        preempted = d.step().preempted
    assert preempted == [b]
    assert b.status is SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and d.sched.num_preemptions == 1
    # Back at its original place: ahead of the later arrival c.
    assert [s.request_id for s in d.sched.waiting] == ["b", "c"]
    outputs_before = list(b.output_token_ids)
    assert outputs_before  # it had generated tokens, which will be recomputed, not resampled
    d.run()
    assert a.output_token_ids == reference(a)
    assert b.output_token_ids == reference(b)
    assert b.output_token_ids[: len(outputs_before)] == outputs_before
    assert d.pool.num_free == 4


def test_a_request_that_fits_alone_is_never_failed():
    """Two requests that each need the whole pool take turns through preemption."""
    d = Driver(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = d.add("a", 4, max_tokens=8)  # 12 tokens = 3 blocks
    b = d.add("b", 4, max_tokens=8)
    d.run()
    assert a.output_token_ids == reference(a)
    assert b.output_token_ids == reference(b)
    assert d.sched.num_preemptions >= 1
    assert d.pool.num_free == 3


def test_a_running_request_preempts_itself_when_it_is_the_newest():
    d = Driver(num_blocks=3, block_size=2, enable_prefix_caching=False)
    a = d.add("a", 2, max_tokens=2)  # 4 tokens: 2 blocks
    b = d.add("b", 2, max_tokens=2)
    d.step()
    assert {s.request_id for s in d.sched.running} == {"a", "b"}
    # a takes the last free block; then b, the newest, needs one and must give way itself.
    batch = d.step()
    assert batch.preempted == [b] and plan(batch) == [("a", 2, 1)]
    d.run()
    assert a.is_finished and b.is_finished


def test_preempted_request_reuses_its_cached_prefix():
    d = Driver(num_blocks=5, block_size=4)
    d.add("a", 8, max_tokens=12)
    b = d.add("b", 8, max_tokens=4)
    while not b.num_preemptions:
        d.step()
    # b's full prompt blocks were published; readmission finds them again.
    hits = d.kv.find_cached_prefix(b)
    assert len(hits) >= 1
    d.run()
    assert b.output_token_ids == reference(b)
    assert d.pool.num_free == 5


def test_admission_with_prefix_hits_computes_only_the_rest():
    d = Driver(block_size=4)
    d.add("a", list(range(20)), max_tokens=1)
    d.run()
    b = d.add("b", [*range(16), 99, 98], max_tokens=1)
    assert plan(d.step()) == [("b", 16, 2)]
    assert b.num_cached_tokens == 16
    c = d.add("c", list(range(20)), max_tokens=1)  # identical: the last token is recomputed
    assert plan(d.step()) == [("c", 16, 4)]
    assert c.num_cached_tokens == 16
    assert d.kv.prefix_stats.hit_rate == pytest.approx(32 / 58)


def test_priority_orders_the_queue():
    d = Driver(max_num_seqs=1)
    d.add("low", 3, max_tokens=1, priority=1)
    d.add("high", 3, max_tokens=1, priority=0)
    assert [s for s, _, _ in plan(d.step())] == ["high"]


def test_finish_of_a_waiting_request_removes_it():
    d = Driver()
    seq = d.add("a", 3)
    d.sched.finish(seq, "abort")
    assert seq.is_finished and seq.finish_reason == "abort"
    assert len(d.sched) == 0
    assert not d.step()


def test_min_batch_size_waits_briefly_but_never_stalls():
    d = Driver(min_batch_size=3, batch_wait_s=0.2)
    d.add("a", 3, max_tokens=1)
    assert not d.step()  # nearly idle: hold off for more arrivals
    assert 0 < d.sched.should_wait_for_batch(time.monotonic()) <= 0.2
    d.add("b", 3, max_tokens=1)
    d.add("c", 3, max_tokens=1)
    assert [s for s, _, _ in plan(d.step())] == ["a", "b", "c"]  # enough arrivals: go

    d2 = Driver(min_batch_size=4, batch_wait_s=0.05)
    d2.add("lone", 3, max_tokens=2)
    start = time.monotonic()
    while not d2.step():
        assert time.monotonic() - start < 10.0, "a lone request was stalled"
    assert time.monotonic() - start >= 0.04
    # Once something runs, there is no waiting at all.
    assert d2.sched.should_wait_for_batch(time.monotonic()) == 0.0
    d2.add("late", 3, max_tokens=1)
    assert [s for s, _, _ in plan(d2.step())] == ["lone", "late"]


def test_step_ids_increase():
    d = Driver()
    d.add("a", 2, max_tokens=2)
    ids = [d.step().step_id for _ in range(3)]
    assert ids == [1, 2, 3]
