"""`BlockPoolBatchEngine`: mlx-lm's `BatchGenerator` with shoal's block pool and agent sessions.

Design input 001, on the torch engine's torch-free parts so an agent's session behaves the same
on both backends: `BlockPool` accounts 256-token blocks, `SessionManager` owns each agent's KV
(pinned while a request of it runs, idle ones spilled least recently used first, restored from
the session files after a restart) and `KVCacheManager` finds the prefix a turn reuses. The
bytes live in `BlockData` (see `kv.py`).

A turn's life: `submit` validates and queues (any thread). `step` (one thread) admits queued
requests in FIFO order, deferring one whose agent already has a request running (design input
002), reconstructs the reused prefix once and inserts the rest of the prompt into the
`BatchGenerator`; every generated token is accounted, taking a new block at each 256-token
boundary; a finished request's cache becomes the agent's blocks. When no block is left for a
boundary the request ends with `finish_reason="pool_exhausted"`, keeping what it computed.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.generate import BatchGenerator

from shoal.backends.mlx.kv import BlockData, ModelCacheSpec, as_caches
from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.input_processor import InputProcessor, check_session_id
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.engine.sessions import SessionInfo, SessionManager
from shoal.errors import (
    CacheCorruptionError,
    InvalidRequestError,
    PoolExhaustedError,
    PromptTooLongError,
)
from shoal.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class AgentBlocks:
    """An agent's KV after a turn: the tokens it holds and the pool blocks holding them."""

    agent_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class CompletedGeneration:
    uid: int
    agent_id: str
    text: str
    token_ids: list[int]  # generated, a stop token included
    blocks: AgentBlocks
    finish_reason: str  # "stop", "length", "pool_exhausted" or "abort"
    token_count: int
    num_cached_tokens: int  # prompt tokens served from the agent's KV


@dataclass(slots=True, eq=False)
class _Request:
    uid: int
    seq: Sequence
    max_tokens: int
    gen_uid: int = -1


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
        disk_cap_bytes: int = 8 << 30,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
    ) -> None:
        if pool.block_size != spec.block_tokens:
            raise InvalidRequestError(
                f"pool blocks of {pool.block_size} tokens, spec blocks of {spec.block_tokens}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.spec = spec
        self.max_model_len = max_model_len
        self.data = BlockData(spec, cache_dir)
        self.sessions = SessionManager(pool, self.data, disk_cap_bytes)
        self.kv = KVCacheManager(pool, b"", enable_prefix_caching=False, sessions=self.sessions)
        vocab = model.model.embed_tokens.weight.shape[0]
        self.inputs = InputProcessor(
            tokenizer, vocab, max_model_len, pool.num_blocks, spec.block_tokens, "cpu"
        )
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
        )
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
        with self._inbox_lock:
            uid = next(self._uids)
            seq = Sequence(str(uid), tokens, params, session_id=agent_id)
            self._inbox.append(_Request(uid, seq, max_tokens))
        return uid

    def cancel(self, uid: int) -> None:
        """End a request at the next step (`finish_reason="abort"`), keeping its computed KV."""
        with self._inbox_lock:
            self._cancel.add(uid)

    # -- the step thread -----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._running)

    def step(self) -> Iterator[CompletedGeneration]:
        """Admit what fits, decode one token for every running request, and return the
        requests that finished. The work is done before this returns, iterated or not."""
        with self._lock:
            return iter(self._step())

    def _step(self) -> list[CompletedGeneration]:
        with self._inbox_lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            cancel, self._cancel = self._cancel, set()
        done = self._cancel_requested(cancel)
        self._admit()
        if self._running:
            _, responses = self._gen.next()
            for r in responses:
                req = self._running[r.uid]
                req.seq.output_token_ids.append(r.token)
                grown = self.kv.allocate(req.seq, 1)  # its KV is in the cache: account for it
                if grown:
                    req.seq.num_computed_tokens += 1
                if r.finish_reason is not None:
                    done.append(self._finish(req, r.finish_reason, r.prompt_cache))
                elif not grown:
                    caches = self._gen.remove([r.uid], return_prompt_caches=True)[r.uid][0]
                    done.append(self._finish(req, "pool_exhausted", caches))
        return done

    def _cancel_requested(self, cancel: set[int]) -> list[CompletedGeneration]:
        done = []
        for uid in cancel:
            for req in [r for r in self._waiting if r.uid == uid]:
                self._waiting.remove(req)
                req.seq.status = SequenceStatus.FINISHED
                done.append(self._completion(req, "abort", []))
            for gen_uid, req in list(self._running.items()):
                if req.uid == uid:
                    caches = self._gen.remove([gen_uid], return_prompt_caches=True)[gen_uid][0]
                    done.append(self._finish(req, "abort", caches))
        return done

    def _admit(self) -> None:
        """FIFO admission; a request whose agent is busy waits without holding up the rest."""
        busy = {r.seq.session_id for r in self._running.values()}
        for req in list(self._waiting):
            if req.seq.session_id in busy:
                continue
            if not self._allocate(req.seq):
                return  # keep FIFO: a later request may not jump ahead for memory
            self._waiting.remove(req)
            busy.add(req.seq.session_id)
            self._start(req)

    def _allocate(self, seq: Sequence) -> bool:
        hit = self.kv.find_prefix(seq)
        if self.kv.allocate_hit(seq, seq.num_tokens - hit.num_tokens, hit):
            self.kv.admitted(seq, hit)
            return True
        if self._running or hit.session is None:
            return False
        # Alone in an idle engine, only its own agent's blocks can stand in the way.
        self.sessions.evict(hit.session)
        hit = self.kv.find_prefix(seq, use_session=False)
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
            max_tokens=[req.max_tokens],
            caches=[caches] if caches else None,
            all_tokens=[tokens[:n]],
        )
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._running[req.gen_uid] = req

    def _finish(self, req: _Request, reason: str, caches: list[Any]) -> CompletedGeneration:
        """Hand the request's computed KV to its agent and free the rest."""
        seq = req.seq
        del self._running[req.gen_uid]
        # A request removed mid-prefill holds less than its prompt; an unstarted one, nothing.
        held = caches[0].offset if caches and caches[0].keys is not None else 0
        seq.num_computed_tokens = n = min(seq.num_computed_tokens, held)
        if n:
            self.data.put(seq.block_table, [(c.keys, c.values) for c in caches], n)
        self.kv.free(seq, keep=True)
        seq.status = SequenceStatus.FINISHED
        self.data.sweep(self.pool)
        return self._completion(req, reason, seq.output_token_ids)

    def _completion(self, req: _Request, reason: str, tokens: list[int]) -> CompletedGeneration:
        agent_id = req.seq.session_id
        assert agent_id is not None
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
            session = self.sessions.get(agent_id)
            return self.sessions.info(session) if session else None

    def close(self) -> None:
        """Save what a persistent disk tier lacks and stop."""
        self.save_sessions()
        self._gen.close()
