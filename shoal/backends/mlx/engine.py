"""`BlockPoolBatchEngine`: mlx-lm's `BatchGenerator` with shoal's block pool and agent sessions.

Design input 001, on the torch engine's torch-free parts so an agent's session behaves the same
on both backends: `BlockPool` accounts 256-token blocks, `SessionManager` owns each agent's KV
(pinned while a request of it runs, idle ones spilled least recently used first, restored from
the session files after a restart) and `KVCacheManager` finds the prefix a turn reuses. The
bytes live in `BlockData` (see `kv.py`).

A turn's life: `submit` validates and queues (any thread). `step` (one thread) admits queued
requests in (priority, FIFO) order, deferring one whose agent already has a request running
(design input 002), reconstructs the reused prefix once and inserts the rest of the prompt into
the `BatchGenerator`; every generated token is accounted, taking a new block at each 256-token
boundary; a finished request's cache becomes the agent's blocks. When no block is left for a
boundary the request ends with `finish_reason="pool_exhausted"`, keeping what it computed.

The shared `OutputProcessor` decides when a request ends, as on torch. `submit_sequence` and
`step_sequences` serve `MLXEngine` (`adapter.py`): `Sequence`s from the shared `InputProcessor`,
any sampling parameters, reported after every token; one without a session leaves no KV.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.generate import BatchGenerator

from shoal.backends.mlx.kv import BlockData, ModelCacheSpec, as_caches
from shoal.backends.mlx.outputs import AgentBlocks, CompletedGeneration
from shoal.backends.mlx.sampling import make_sampler, sampled, seed_key
from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.block_store import build_store
from shoal.engine.detokenizer import Detokenizer
from shoal.engine.input_processor import InputProcessor, check_session_id
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.engine.sessions import SessionInfo
from shoal.errors import (
    CacheCorruptionError,
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
)
from shoal.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class _Request:
    uid: int
    seq: Sequence
    report: bool  # a `submit` request: `step` returns its `CompletedGeneration`
    gen_uid: int = -1
    completion: CompletedGeneration | None = None  # made as it ends: its blocks at that moment


class BlockPoolBatchEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        pool: BlockPool,
        spec: ModelCacheSpec,
        *,
        eos_token_ids: list[int] | None = None,
        max_model_len: int = 8192,
        cache_dir: str | Path | None = None,
        host_kv_bytes: int = 2 << 30,
        disk_kv_bytes: int = 8 << 30,
        shared_dir: str | Path | None = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        stream_text: bool = False,
    ) -> None:
        """`stream_text`: keep `Sequence.text` current after every token (for streaming and
        stop strings); without it text is decoded once, at the end."""
        if pool.block_size != spec.block_tokens:
            raise InvalidRequestError(
                f"pool blocks of {pool.block_size} tokens, spec blocks of {spec.block_tokens}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.spec = spec
        self.max_model_len = max_model_len
        self.data = BlockData(spec)
        self.store, self.sessions = build_store(
            spec.layout(),
            pool,
            self.data,
            cache_dir=cache_dir,
            host_kv_bytes=host_kv_bytes,
            disk_kv_bytes=disk_kv_bytes,
            shared_dir=shared_dir,
        )
        self.kv = KVCacheManager(
            pool, self.sessions.root, enable_prefix_caching=False, sessions=self.sessions
        )
        vocab = model.model.embed_tokens.weight.shape[0]
        self.inputs = InputProcessor(
            tokenizer, vocab, max_model_len, pool.num_blocks, spec.block_tokens, seed_key
        )
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        detokenizer = Detokenizer(tokenizer if stream_text else None)
        self.outputs = OutputProcessor(detokenizer, set(eos), max_model_len)
        self._gen = BatchGenerator(  # no stop tokens: `self.outputs` decides when a request ends
            model,
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        self.step_id = 0
        self.num_generated_tokens = 0
        self._inbox_lock = threading.Lock()  # submit and cancel: never held across a step
        self._inbox: list[_Request] = []
        self._cancel: set[int] = set()
        self._uids = itertools.count()
        self._lock = threading.Lock()  # the step and session control
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # by BatchGenerator uid

    # -- any thread ----------------------------------------------------------------------------
    def submit(
        self,
        agent_id: str,
        prompt: str | list[int],
        cache: AgentBlocks | None = None,
        max_tokens: int = 256,
    ) -> int:
        """Queue a turn of `agent_id`; returns its uid. Thread-safe.

        `prompt` continues `cache` (the blocks of the agent's previous turn) when given, else
        it is the whole context; either way the agent's stored KV serves the longest common
        prefix. Raises `InvalidRequestError` for bad input, `CacheCorruptionError` for a cache
        that is not this model's or this agent's, `PoolExhaustedError` when even an empty pool
        could not hold the prompt.
        """
        check_session_id(agent_id)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        tokens = self.inputs.encode(prompt)
        if not tokens:
            raise InvalidRequestError("the prompt is empty")
        if cache is not None:
            if cache.agent_id != agent_id:
                raise InvalidRequestError(
                    f"cache of agent {cache.agent_id!r} passed for agent {agent_id!r}"
                )
            if cache.block_tokens != self.spec.block_tokens or len(cache.block_ids) != cdiv(
                cache.num_tokens, cache.block_tokens
            ):
                raise CacheCorruptionError("the cache's blocks do not match this engine's")
            tokens = list(cache.token_ids) + tokens
        if len(tokens) >= self.max_model_len:
            raise PromptTooLongError(
                f"{len(tokens)} tokens; this model takes at most {self.max_model_len - 1}"
            )
        if cdiv(len(tokens) + 1, self.spec.block_tokens) > self.pool.num_blocks:
            raise PoolExhaustedError(
                f"{len(tokens)} prompt tokens need more than the pool's {self.pool.num_blocks} "
                f"blocks of {self.spec.block_tokens}"
            )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return self._queue(Sequence(agent_id, tokens, params, session_id=agent_id), report=True)

    def submit_sequence(self, seq: Sequence) -> int:
        """Queue a request that `self.inputs.process` validated; returns its uid. Thread-safe.

        Its sampling parameters apply as given; without a `session_id` its KV is freed when it
        ends. Its progress is reported by `step_sequences`.
        """
        return self._queue(seq, report=False)

    def _queue(self, seq: Sequence, report: bool) -> int:
        with self._inbox_lock:
            uid = next(self._uids)
            self._inbox.append(_Request(uid, seq, report))
        return uid

    def cancel(self, uid: int) -> None:
        """End a request at the next step (`finish_reason="abort"`), keeping its computed KV."""
        with self._inbox_lock:
            self._cancel.add(uid)

    # -- the step thread -----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self._waiting)

    def step(self) -> Iterator[CompletedGeneration]:
        """Admit what fits, decode one token for every running request, and return the
        requests that finished. The work is done before this returns, iterated or not."""
        with self._lock:
            return iter([r.completion for r in self._step() if r.completion is not None])

    def step_sequences(self, decode: bool = True) -> list[Sequence]:
        """`step` for `submit_sequence` callers: every request that gained a token or finished
        (`finish_reason` set), as submitted. `decode=False` only takes in submissions and
        cancellations, so everything cancelled comes back without another token computed."""
        with self._lock:
            return [r.seq for r in self._step(decode)]

    def _step(self, decode: bool = True) -> list[_Request]:
        with self._inbox_lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            cancel, self._cancel = self._cancel, set()
        moved = self._cancel_requested(cancel)
        if decode:
            self._admit()
        if decode and self._running:
            _, responses = self._gen.next()
            self.step_id += 1
            moved += self._record(responses)
        return moved

    def _record(self, responses: list[Any]) -> list[_Request]:
        """Give each running request its token; finish those the output processor stops, the
        generator finished, or the pool cannot extend."""
        reqs = [self._running[r.uid] for r in responses]
        seqs = [req.seq for req in reqs]
        tokens = [r.token for r in responses]
        stops = self.outputs.process(
            seqs, sampled(tokens, [r.logprobs for r in responses], seqs), time.monotonic()
        )
        stopped = {id(seq): reason for seq, reason in stops}
        self.num_generated_tokens += len(responses)
        for req, r in zip(reqs, responses, strict=True):
            seq = req.seq
            grown = self.kv.allocate(seq, 1)  # its KV is in the cache: account for it
            if grown:
                seq.num_computed_tokens += 1
            reason = stopped.get(id(seq)) or r.finish_reason
            if reason is None and not grown:
                reason = "pool_exhausted"
                self.outputs.detokenizer.update(seq, finishing=True)  # release held-back text
            if reason is not None:
                # The generator hands over the cache of what it finished; the rest leave here.
                caches = r.prompt_cache if r.finish_reason is not None else self._remove(r.uid)
                self._finish(req, reason, caches)
        return reqs

    def _remove(self, gen_uid: int) -> list[Any]:  # out of the generator's batch: its cache
        caches: list[Any] = self._gen.remove([gen_uid], return_prompt_caches=True)[gen_uid][0]
        return caches

    def _cancel_requested(self, cancel: set[int]) -> list[_Request]:
        done = []
        for uid in cancel:
            for req in [r for r in self._waiting if r.uid == uid]:
                self._waiting.remove(req)
                self._ended(req, "abort")
                done.append(req)
            for gen_uid, req in list(self._running.items()):
                if req.uid == uid:
                    self._finish(req, "abort", self._remove(gen_uid))
                    done.append(req)
        return done

    def _admit(self) -> None:
        """(priority, FIFO) admission; a request whose agent is busy waits without holding up
        the rest."""
        busy = {r.seq.session_id for r in self._running.values()}
        for req in sorted(self._waiting, key=lambda r: r.seq.priority):  # stable: FIFO within
            sid = req.seq.session_id
            if sid is not None and sid in busy:
                continue
            if not self._allocate(req.seq):
                return  # keep the order: a later request may not jump ahead for memory
            self._waiting.remove(req)
            busy.add(sid)
            self._start(req)

    def _allocate(self, seq: Sequence) -> bool:
        hit = self.kv.find_prefix(seq)
        if self.kv.allocate_hit(seq, seq.num_tokens - hit.num_tokens, hit):
            self.kv.admitted(seq, hit)
            return True
        if self._running or hit.session is None or not hit.session.resident:
            return False
        # Alone in an idle engine, only its own agent's blocks can stand in the way: given back
        # to the pool, they stay cached there for the prefix to reuse.
        self.sessions.evict(hit.session)
        hit = self.kv.find_prefix(seq)
        if not self.kv.allocate_hit(seq, seq.num_tokens - hit.num_tokens, hit):
            return False
        self.kv.admitted(seq, hit)
        return True

    def _start(self, req: _Request) -> None:
        seq = req.seq
        seq.status = SequenceStatus.RUNNING
        n = seq.num_computed_tokens
        caches = None
        if n:
            try:
                caches = as_caches(self.data.gather(seq.block_table, n), n)
            except CacheCorruptionError as e:
                warnings.warn(f"agent {seq.session_id!r}: {e}; recomputing", stacklevel=2)
                n = seq.num_cached_tokens = 0
        tokens = seq.prompt_token_ids
        (req.gen_uid,) = self._gen.insert(
            [tokens[n:]],
            max_tokens=[min(seq.params.max_tokens, self.max_model_len - len(tokens))],
            caches=[caches] if caches else None,
            all_tokens=[tokens[:n]],
            samplers=[make_sampler(seq) or self._gen.sampler],  # greedy: one shared argmax
        )
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._running[req.gen_uid] = req

    def _finish(self, req: _Request, reason: str, caches: list[Any]) -> None:
        """Hand the request's computed KV to its agent (if it has one) and free the rest."""
        seq = req.seq
        del self._running[req.gen_uid]
        # A request removed mid-prefill holds less than its prompt; an unstarted one, nothing.
        held = caches[0].offset if caches and caches[0].keys is not None else 0
        seq.num_computed_tokens = n = min(seq.num_computed_tokens, held)
        if n and seq.session_id is not None:
            self.data.put(seq.block_table, [(c.keys, c.values) for c in caches], n)
        self.kv.free(seq, keep=True)
        self.data.sweep(self.pool)
        self._ended(req, reason)

    def _ended(self, req: _Request, reason: str) -> None:
        req.seq.status = SequenceStatus.FINISHED
        req.seq.finish_reason = reason
        if req.report:
            req.completion = self._completion(req, reason)

    def _completion(self, req: _Request, reason: str) -> CompletedGeneration:
        agent_id = req.seq.session_id
        assert agent_id is not None
        tokens = req.seq.output_token_ids
        session = self.sessions.get(agent_id)
        blocks = AgentBlocks(
            agent_id,
            tuple(session.token_ids if session else ()),
            tuple(session.block_ids if session else ()),
            self.spec.block_tokens,
        )
        shown = tokens[:-1] if reason == "stop" else tokens
        return CompletedGeneration(
            uid=req.uid,
            agent_id=agent_id,
            text=self.tokenizer.decode(shown),
            token_ids=list(tokens),
            blocks=blocks,
            finish_reason=reason,
            token_count=len(tokens),
            num_cached_tokens=req.seq.num_cached_tokens,
        )

    # -- agents' sessions ----------------------------------------------------------------------
    def save_sessions(self) -> int:
        """Write every agent's KV that the disk tier lacks; returns how many were written."""
        with self._lock:
            return self.sessions.flush()

    def drop_session(self, agent_id: str) -> bool:
        with self._lock:
            dropped = self.sessions.drop(agent_id)
            self.data.sweep(self.pool)
            return dropped

    def session_info(self, agent_id: str) -> SessionInfo | None:
        with self._lock:
            return self.sessions.info_of(agent_id)

    def list_sessions(self) -> list[SessionInfo]:
        """Every agent's session in memory or on disk, most recently used first."""
        with self._lock:
            return self.sessions.infos()

    def close(self) -> None:
        """Save what a persistent disk tier lacks and stop."""
        self.save_sessions()
        self._gen.close()
