"""The synchronous engine: `add_request`, `abort`, `step`.

Submitting and aborting are thread-safe (they go through an inbox the step drains); the step
loop itself runs on one thread. Each step: schedule, run the model, append the sampled tokens,
finish what is done and free its blocks, and return a snapshot of every request that moved.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from shoal.config import EngineConfig
from shoal.engine.block_pool import BlockPool
from shoal.engine.detokenizer import Detokenizer
from shoal.engine.hashing import root_hash
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_store import KVLayout, SessionStore
from shoal.engine.model_runner import ModelRunner
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence
from shoal.engine.sessions import SessionInfo, SessionTable
from shoal.errors import (
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
)
from shoal.models.llama import LlamaForCausalLM
from shoal.models.loader import DTYPES, LoadedModel, load_model
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineStats:
    step_id: int
    num_running: int
    num_waiting: int
    blocks_used: int
    blocks_free: int
    kv_bytes_used: int
    kv_utilization: float  # percent of the pool in use
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_generated_tokens: int
    num_sessions: int = 0
    session_hits: int = 0  # session requests admitted reusing their session's KV
    session_tokens_reused: int = 0  # prompt tokens of session requests not computed
    session_tokens_recomputed: int = 0  # prompt tokens of session requests computed
    disk_reads: int = 0
    disk_writes: int = 0
    restore_latency_p50_ms: float = 0.0  # disk read + validation + copy into the pool
    restore_latency_p95_ms: float = 0.0


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        loaded = load_model(config.model, config.dtype)
        self._setup(loaded)

    def _setup(self, loaded: LoadedModel) -> None:
        config = self.config
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
        )
        dtype = DTYPES[config.dtype]
        bytes_per_block = config.block_size * loaded.config.kv_bytes_per_token(dtype.itemsize)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // bytes_per_block)
        self.bytes_per_block = bytes_per_block
        self.pool = BlockPool(num_blocks, config.block_size)
        self.fingerprint = loaded.fingerprint
        self.sessions = SessionTable()
        self.kv = KVCacheManager(
            self.pool,
            root_hash(f"{loaded.fingerprint}:{config.dtype}"),
            config.enable_prefix_caching,
            self.sessions,
        )
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        model = LlamaForCausalLM(loaded.config, loaded.weights, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.device)
        cfg = loaded.config
        layout = KVLayout(
            self.fingerprint,
            config.dtype,
            config.block_size,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.store = SessionStore(
            self.runner, self.sessions, layout, config.cache_dir, config.disk_cache_bytes
        )
        self.kv.io = self.store
        self._save_lock = threading.Lock()
        self.detokenizer = Detokenizer(self.tokenizer)
        self._requests: dict[str, Sequence] = {}
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self.num_generated_tokens = 0

    # -- submission (any thread) -------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids for a conversation, ending where the assistant's reply begins.

        Raises `InvalidRequestError` when the model has no tokenizer or no chat template; an
        error the template itself raises (a conversation it rejects) propagates unchanged.
        """
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        session_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises typed errors for bad input.

        With `session_id`, the request reuses what its session holds (the KV of the session's
        last turn) and leaves its own KV to the session; it waits while the session is busy.
        """
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise InvalidRequestError("session_id must be a non-empty string")
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        params = params or SamplingParams()
        params.validate()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} so that one can be generated"
            )
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if self.kv.blocks_needed(longest) > self.pool.num_blocks:
            raise PromptTooLongError(
                f"{longest} tokens need {self.kv.blocks_needed(longest)} KV blocks but the pool "
                f"has {self.pool.num_blocks}: lower max_tokens or grow kv_cache_bytes"
            )
        seq = Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            priority=priority,
            session_id=session_id,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        if params.seed is not None:
            seq.generator = torch.Generator(self.config.device).manual_seed(params.seed)
        with self._lock:
            if seq.request_id in self._requests:
                raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
            if len(self._requests) >= self.config.max_waiting:
                raise QueueFullError("too many requests are queued")
            self._requests[seq.request_id] = seq
            self._inbox.append(("add", seq))
        return seq.request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            # Resolve the id now: an id not (yet) submitted names nothing to abort, and a later
            # request that reuses it must not be hit (nor meet the abort before its own add).
            seq = self._requests.get(request_id)
            if seq is not None:
                self._inbox.append(("abort", seq))

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)

    # -- the step loop (one thread) ------------------------------------------------------
    def _drain_inbox(self) -> list[RequestOutput]:
        aborted = []
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                self.scheduler.add(item)
                continue
            seq = item
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                aborted.append(self._finish_output(seq))
        return aborted

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        with self._lock:
            self._requests.pop(seq.request_id, None)
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        want_logprobs = seq.params.logprobs is not None
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if want_logprobs else None,
            top_logprobs=list(seq.top_logprobs) if want_logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
        )

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        """One iteration: returns a snapshot of every request that gained text or finished."""
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        if not batch:
            wait = self.scheduler.should_wait_for_batch(time.monotonic())
            if wait > 0:
                time.sleep(min(wait, 0.001))
            self._save_if_closing()
            return outputs
        seqs, sampled = self.runner.execute(batch)
        now = time.monotonic()
        finished: list[tuple[Sequence, str]] = []
        for i, seq in enumerate(seqs):
            token = sampled.token_ids[i]
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if sampled.logprobs is not None and sampled.top_logprobs is not None:
                seq.logprobs.append(sampled.logprobs[i])
                seq.top_logprobs.append(sampled.top_logprobs[i])
            reason = self._check_stop(seq, token)
            if self.detokenizer.update(seq, finishing=reason is not None):
                reason = "stop"
            if reason is not None:
                finished.append((seq, reason))
        self.num_generated_tokens += len(seqs)
        for seq in batch.seqs:
            self.kv.commit(seq)
        done = {id(s) for s, _ in finished}
        for seq, reason in finished:
            self.scheduler.finish(seq, reason)
            outputs.append(self._finish_output(seq))
        outputs += [self._output(s) for s in seqs if id(s) not in done]
        self._save_if_closing()
        return outputs

    def _save_if_closing(self) -> None:
        if self._closed and not self.has_unfinished_requests():
            self.save_sessions()  # the last request of a closing engine is done

    # -- control -------------------------------------------------------------------------
    def reset(self) -> list[RequestOutput]:
        """Abort everything (design input 000's RefreshBatch); only sessions keep blocks."""
        with self._lock:
            ids = list(self._requests)
        for request_id in ids:
            self.abort(request_id)
        outputs = self._drain_inbox()
        self.pool.evict_cached()
        return outputs

    def close(self) -> None:
        """Take no new requests; save unsaved session KV to `cache_dir` once nothing runs."""
        self._closed = True
        self._save_if_closing()

    # -- sessions ------------------------------------------------------------------------
    def save_sessions(self) -> int:
        """Write every session whose disk copy is missing or stale (only with a cache_dir)."""
        with self._save_lock:
            return self.store.flush()

    def list_sessions(self) -> list[SessionInfo]:
        """Every session held in memory or on disk, most recently used first."""
        infos = [self.sessions.info(s) for s in self.sessions.sessions.values()]
        return sorted(infos, key=lambda i: -i.last_used)

    def session_info(self, session_id: str) -> SessionInfo | None:
        session = self.sessions.get(session_id)
        return self.sessions.info(session) if session is not None else None

    def drop_session(self, session_id: str) -> bool:
        """Forget a session's KV, in memory and on disk; call between steps. False if unknown."""
        dropped = self.kv.drop_session(session_id) is not None
        self.store.delete(session_id)
        return dropped

    def stats(self) -> EngineStats:
        pool = self.pool
        ss = self.sessions.stats
        return EngineStats(
            step_id=self.scheduler.step_id,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            blocks_used=pool.num_used,
            blocks_free=pool.num_free,
            kv_bytes_used=pool.num_used * self.bytes_per_block,
            kv_utilization=100.0 * pool.num_used / pool.num_blocks,
            prefix_cache_hit_rate=self.kv.prefix_stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_sessions=len(self.sessions),
            session_hits=ss.hits,
            session_tokens_reused=ss.tokens_reused,
            session_tokens_recomputed=ss.tokens_recomputed,
            disk_reads=ss.disk_reads,
            disk_writes=ss.disk_writes,
            restore_latency_p50_ms=1e3 * ss.restore_percentile(0.50),
            restore_latency_p95_ms=1e3 * ss.restore_percentile(0.95),
        )
