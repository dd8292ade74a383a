"""Iteration-level scheduling with one token budget per step (vLLM v1's design).

There is no prefill phase and no decode phase: every request's `num_computed_tokens` chases
its `num_tokens`. Each step first serves running requests (a decode costs one token, an
unfinished prefill takes a chunk of what is left), then admits waiting ones in
(priority, arrival) order while the budget, `max_num_seqs` and free blocks allow. When a
running request needs a block and none is free, the lowest-priority, newest running request
is preempted: its blocks are freed (its cached prefix usually survives) and it goes back to
the queue at its original place, to be recomputed later.

A greedy request that is decoding may carry draft tokens (`engine/ngram.py`, when
`num_speculative_tokens` is set): they take budget and KV slots like any other token, but only
when both are to spare, never at the cost of a preemption; the engine rewinds
`num_computed_tokens` past the drafts the model rejected.

A request whose session already has a request running, or waiting ahead of it, is deferred:
it keeps its place and the requests behind it go on (skip, don't break), so one busy session
cannot hold up the others, and it starts once its session is free.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from shoal.config import EngineConfig
from shoal.engine.kv_cache_manager import KVCacheManager, PrefixHit
from shoal.engine.ngram import NgramProposer
from shoal.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: for each sequence, `num_new_tokens` from position `starts`."""

    step_id: int
    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._order: dict[int, tuple[int, int]] = {}  # id(seq) -> (priority, arrival number)
        self._arrivals = itertools.count()
        self.step_id = 0
        self.num_preemptions = 0
        self.proposer = None
        if config.num_speculative_tokens:
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min
            )

    # -- queue management -------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[int, int]:
        return self._order[id(seq)]

    def add(self, seq: Sequence) -> None:
        self._order[id(seq)] = (seq.priority, next(self._arrivals))
        bisect.insort(self.waiting, seq, key=self._key)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the batch and give its blocks back, in the same step."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq, keep=reason != "abort")  # an aborted turn leaves its session as is
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._order[id(seq)]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._key)

    # -- the step ----------------------------------------------------------------------
    def should_wait_for_batch(self, now: float) -> float:
        """Seconds to hold off so a nearly idle engine can gather `min_batch_size` arrivals.

        Bounded by `batch_wait_s` from the oldest arrival: a lone request is never stalled.
        """
        if self.running or not self.waiting or len(self.waiting) >= self.config.min_batch_size:
            return 0.0
        oldest = min(s.arrival_time for s in self.waiting)
        return max(0.0, oldest + self.config.batch_wait_s - now)

    def schedule(self) -> ScheduledBatch:
        self.step_id += 1
        batch = ScheduledBatch(self.step_id)
        if self.should_wait_for_batch(time.monotonic()) > 0:
            return batch
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Sequence, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 1 and self._draft(seq, budget - 1):
                planned.append((seq, 1 + len(seq.draft_token_ids)))
                budget -= planned[-1][1]
                i += 1
                continue
            while not self.kv.allocate(seq, n):
                victim = self.running[-1]  # sorted by (priority, arrival): the newest, least urgent
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                planned.append((seq, n))
                budget -= n
                i += 1

        if not batch.preempted:
            busy = {s.session_id for s in self.running if s.session_id is not None}
            j = 0
            while j < len(self.waiting) and budget > 0:
                if len(self.running) >= self.config.max_num_seqs:
                    break
                seq = self.waiting[j]
                if seq.session_id is not None:
                    if seq.session_id in busy:
                        j += 1  # deferred: it keeps its place, the requests behind it go on
                        continue
                    busy.add(seq.session_id)
                admitted = self._admit(seq, budget)
                if admitted is None:
                    break  # keep FIFO: a later request may not jump ahead for memory
                n, hit = admitted
                self.kv.admitted(seq, hit)
                del self.waiting[j]
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=self._key)
                planned.append((seq, n))
                budget -= n

        for seq, n in planned:
            batch.seqs.append(seq)
            batch.starts.append(seq.num_computed_tokens)
            batch.num_new_tokens.append(n)
            seq.num_computed_tokens += n
        return batch

    def _draft(self, seq: Sequence, budget: int) -> bool:
        """Propose drafts for a decoding `seq` and allocate their slots with its next token's;
        False (no drafts) where it is not greedy, nothing matches, or no room is to spare."""
        p = seq.params
        if self.proposer is None or not p.greedy or p.logprobs is not None or seq.grammar:
            return False
        # Every draft must be a position the model can take and a token the request may emit.
        room = min(budget, self.max_model_len - seq.num_tokens)
        room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        drafts = self.proposer.propose(seq, room)
        if not drafts:
            return False
        # Only free blocks, leaving one for every running request's next token.
        need = self.kv.blocks_needed(seq.num_computed_tokens + 1 + len(drafts))
        if need - len(seq.block_table) > self.kv.pool.num_free - len(self.running):
            return False
        allocated = self.kv.allocate(seq, 1 + len(drafts))
        assert allocated, "free blocks were counted above"
        seq.draft_token_ids = drafts
        return True

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, PrefixHit] | None:
        """Allocate a waiting request's first chunk after its reusable prefix; None: no room."""
        hit = self.kv.find_prefix(seq)
        n = min(seq.num_tokens - hit.num_tokens, budget)
        if self.kv.allocate_hit(seq, n, hit):
            return n, hit
        if hit.session is None or not hit.session.resident or self.running:
            return None
        # Alone in an idle engine, only its own session's blocks can stand in the way: given
        # back to the pool, they stay cached there for the prefix to reuse.
        assert self.kv.sessions is not None
        self.kv.sessions.evict(hit.session)
        hit = self.kv.find_prefix(seq)
        n = min(seq.num_tokens - hit.num_tokens, budget)
        return (n, hit) if self.kv.allocate_hit(seq, n, hit) else None
