"""The synchronous engine: `add_request`, `abort`, `step`.

Submitting and aborting are thread-safe: they go through an inbox that the step drains.
Everything else that touches engine state (`step`, `reset`, `drop_session`, `save_sessions`)
runs on one thread, the step thread: the caller's own in a plain loop, or an `AsyncEngine`'s,
which then runs such calls for others between steps (`AsyncEngine.call`). Each step: schedule,
run the model, hand the tokens to the output processor, free what finished in the same step,
and return a snapshot of every request that moved.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from shoal.config import EngineConfig
from shoal.engine.factory import EngineParts, build_engine_parts
from shoal.engine.hashing import Salt
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.pins import CachePin
from shoal.engine.requests import RequestTable
from shoal.engine.sequence import Sequence
from shoal.engine.sessions import SessionInfo
from shoal.engine.stats import EngineStats
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams, StructuredOutput


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        parts: EngineParts | None = None,
        **overrides: Any,
    ) -> None:
        parts = parts or build_engine_parts(config or EngineConfig(**overrides))
        self.config = parts.config
        self.model_name = parts.model_name
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.outputs.eos_token_ids
        self.bytes_per_block = parts.bytes_per_block
        self.pool = parts.pool
        self.runner = parts.runner
        self.sessions = parts.sessions
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.inputs = parts.inputs
        self.outputs = parts.outputs
        self.step_thread: threading.Thread | None = None  # set while an AsyncEngine owns it
        self.num_generated_tokens = 0
        self.num_draft_tokens = 0  # proposed by prompt lookup, and of those kept
        self.num_accepted_tokens = 0
        self._requests: RequestTable[Sequence] = RequestTable(self.config.max_waiting)
        self._inbox: deque[tuple[str, Sequence]] = deque()

    # -- submission (any thread) -------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.inputs.encode(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        check_length: bool = True,
    ) -> list[int]:
        return self.inputs.apply_chat_template(messages, tools, check_length=check_length)

    def compile_structured(self, spec: StructuredOutput) -> Future[Any]:
        """Start compiling a structured-output spec into the cache (any thread; never blocks);
        see `InputProcessor`."""
        return self.inputs.compile_structured(spec)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        session_id: str | None = None,
        cache_pins: Iterable[CachePin] = (),
        cache_salt: Salt | str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises typed errors for bad input.

        With `session_id`, the request reuses what its session holds (the KV of the session's
        last turn) and leaves its own KV to the session; it waits while the session is busy.
        `cache_pins` name prefixes of its KV the store keeps longest once it ends (a client's
        cache key, Anthropic's `cache_control` breakpoints). With `cache_salt` (a text, as
        vLLM's, or a `hashing.Salt`) it reuses only KV computed with the same salt.
        """
        self._requests.check_open()
        seq = self.inputs.process(prompt, params, request_id, priority, session_id, cache_salt)
        seq.cache_pins = tuple(cache_pins)
        with self._requests.lock:
            self._requests.check_new(seq.request_id)
            self._requests[seq.request_id] = seq
            self._inbox.append(("add", seq))
        return seq.request_id

    def abort(self, request_id: str) -> None:
        with self._requests.lock:
            # Resolve the id now: an id not (yet) submitted names nothing to abort, and a later
            # request that reuses it must not be hit (nor meet the abort before its own add).
            seq = self._requests.get(request_id)
            if seq is not None:
                self._inbox.append(("abort", seq))

    def has_unfinished_requests(self) -> bool:
        return len(self._requests) > 0

    # -- the step loop (the step thread) --------------------------------------------------
    def _on_step_thread(self) -> None:
        owner = self.step_thread
        if owner is not None and owner is not threading.current_thread():
            raise RuntimeError("engine state changes on its step thread: use AsyncEngine.call")

    def step(self) -> list[RequestOutput]:
        """One iteration: returns a snapshot of every request that gained text or finished."""
        self._on_step_thread()
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        if not batch:
            wait = self.scheduler.should_wait_for_batch(time.monotonic())
            if wait > 0:
                time.sleep(min(wait, 0.001))
            self._save_if_closing()
            return outputs
        seqs, sampled = self.runner.execute(batch)
        before = sum(s.num_output_tokens for s in seqs)
        finished = self.outputs.process(seqs, sampled, time.monotonic())
        self.num_generated_tokens += sum(s.num_output_tokens for s in seqs) - before
        self.num_accepted_tokens += sum(map(len, sampled.accepted_drafts or []))
        for seq in batch.seqs:
            if seq.draft_token_ids:  # the KV past the kept drafts is not the sequence's
                self.num_draft_tokens += len(seq.draft_token_ids)
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                seq.draft_token_ids = []
            self.kv.commit(seq)
        for seq, reason in finished:
            self.scheduler.finish(seq, reason)
            outputs.append(self._retire(seq))
        done = {id(s) for s, _ in finished}
        outputs += [OutputProcessor.snapshot(s) for s in seqs if id(s) not in done]
        self._save_if_closing()
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._requests.lock:
            items = list(self._inbox)
            self._inbox.clear()
        aborted = []
        for kind, seq in items:
            if kind == "add":
                self.scheduler.add(seq)
                self.kv.prefetch(seq)
            elif not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                aborted.append(self._retire(seq))
        return aborted

    def _retire(self, seq: Sequence) -> RequestOutput:
        self._requests.pop(seq.request_id)
        seq.grammar = None  # its matcher goes with it
        return OutputProcessor.snapshot(seq)

    def _save_if_closing(self) -> None:
        if self._requests.closed and not self.has_unfinished_requests():
            self.sessions.flush()  # the last request of a closing engine is done

    # -- control (the step thread) --------------------------------------------------------
    def reset(self) -> list[RequestOutput]:
        """Abort everything (design input 000's RefreshBatch); only sessions keep blocks."""
        self._on_step_thread()
        for seq in self._requests.values():
            self.abort(seq.request_id)
        outputs = self._drain_inbox()
        self.pool.evict_cached()
        return outputs

    def close(self) -> None:
        """Take no new requests and start no compiles (compiles under way fail at once);
        unsaved session KV goes to `cache_dir` once nothing runs."""
        self._requests.closed = True
        if self.inputs.grammars is not None:
            self.inputs.grammars.close()
        if self.step_thread is None:
            self._save_if_closing()

    def save_sessions(self) -> int:
        """Write every session whose disk copy is missing or stale (only with a cache_dir)."""
        self._on_step_thread()
        return self.sessions.flush()

    def drop_session(self, session_id: str) -> bool:
        """Forget a session's KV, in memory and on disk. False if unknown."""
        self._on_step_thread()
        return self.sessions.drop(session_id)

    def list_sessions(self) -> list[SessionInfo]:
        """Every session held in memory or on disk, most recently used first."""
        return self.sessions.infos()

    def session_info(self, session_id: str) -> SessionInfo | None:
        return self.sessions.info_of(session_id)

    def stats(self) -> EngineStats:
        return EngineStats.collect(
            self.kv,
            self.sessions,
            self.bytes_per_block,
            step_id=self.scheduler.step_id,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            grammars=self.inputs.grammars,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
            weight_bytes=self.runner.weight_bytes(),
        )
