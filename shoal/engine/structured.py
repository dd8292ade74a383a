"""Constrained decoding through xgrammar: compiled grammars, per-sequence matchers, the bitmask.

`Grammars` is one engine's: the tokenizer's vocabulary is read once (on the first constrained
request), and each distinct `StructuredOutput` (keyed by its (kind, spec)) is compiled once,
off the caller's thread and never on the step thread: `grammar_pool.CompilePool` has a worker
process compile it within its time and memory budget, and brings it here. `submit` never
blocks (the server awaits its future); `compile` and `state_for` wait, at most
`GrammarBudget.wait_s`. Compiled grammars are kept in an LRU bounded by bytes (xgrammar's own
`memory_size_bytes`); a grammar a request still holds stays findable after its eviction (weak
references), so a request never compiles twice. Refusals (a spec that does not compile, or
over budget) are remembered by digest, so a repeated hostile spec costs nothing.

Each constrained `Sequence` holds a `GrammarState` (in `Sequence.grammar`, untyped so the
sequence stays torch-free). On the step thread the sampler asks `Grammars.mask` to fill one
bitmask row per constrained sequence in one batched call and to set every token the grammar
cannot take next to -inf; unconstrained rows are never touched, and a step without
constrained rows never gets here. The output processor feeds each appended token to the
state, so the matcher has always accepted exactly `output_token_ids`: a preempted request is
recomputed from its kept tokens without sampling them again, so nothing needs rolling back.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from shoal.engine.grammar_pool import CompilePool, GrammarBusyError, Job, settle
from shoal.engine.grammar_specs import build
from shoal.engine.grammar_worker import GrammarBudget
from shoal.errors import InvalidRequestError
from shoal.sampling_params import StructuredOutput

log = logging.getLogger(__name__)
MAX_REFUSALS_KEPT = 4096


class GrammarState:
    """One sequence's matcher: what its output may continue with."""

    __slots__ = ("grammars", "matcher", "rejected")

    def __init__(self, grammars: Grammars, matcher: Any) -> None:
        self.grammars = grammars
        self.matcher = matcher
        self.rejected = False

    def accept(self, token: int) -> None:
        """Advance by an appended token. A token the mask allowed is always accepted; should
        one ever be refused, the request ends (`finished`) instead of emitting invalid output."""
        if not self.rejected and not self.matcher.accept_token(token):
            log.warning("the grammar refused token %d; ending the request", token)
            self.rejected = True

    @property
    def finished(self) -> bool:
        """The output is complete (the grammar took its stop token), or cannot go on."""
        return self.rejected or bool(self.matcher.is_terminated())


@dataclass(slots=True)
class _Entry:
    compiled: Future[Any]  # settled once, by the pool
    nbytes: int = 0  # the compiled grammar's size, once it is cached
    used: bool = False  # a request has had a matcher of it


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.sha256(f"{key[0]}\0{key[1]}".encode()).digest()


class Grammars:
    """Compiles specs for one tokenizer (cached) and masks logits for constrained rows.
    `misses` counts compiles, `hits` requests served by a grammar compiled before them,
    `refusals` specs refused for their cost (time, memory) or because the queue was full."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        budget: GrammarBudget | None = None,
        cache_bytes: int = 256 << 20,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which can exceed the tokenizer's
        self.stop_token_ids = stop_token_ids
        self.budget = budget or GrammarBudget()
        self.cache_bytes = cache_bytes
        self.hits = 0
        self.misses = 0
        self.refusals = 0
        self.compile_seconds = 0.0
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()  # reading the vocabulary takes a while
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._alive: weakref.WeakValueDictionary[tuple[str, str], Any] = (
            weakref.WeakValueDictionary()
        )
        # digest -> (error class, message): a fresh error each time (a raised error keeps
        # every traceback it went through)
        self._refused: OrderedDict[bytes, tuple[type[InvalidRequestError], str]] = OrderedDict()
        self._info: Any = None
        self._compiler: Any = None
        self._pool = CompilePool(
            self.budget, self._info_json, self._load, self._compile_here, self._count
        )
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, step thread only
        self._bitmask: torch.Tensor | None = None

    @property
    def pending(self) -> int:
        """Compiles queued or running."""
        return self._pool.pending

    def close(self) -> None:
        """Fail the compiles not done (`EngineClosedError`) and stop the workers at once."""
        self._pool.close()

    # -- the pool's side ---------------------------------------------------------------------
    def _xgrammar_compiler(self) -> Any:
        """Built on first use: reading a 49k vocabulary takes a fraction of a second, which
        engines that never see a constrained request should not pay."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _info_json(self) -> str:
        self._xgrammar_compiler()
        return str(self._info.serialize_json())

    def _compile_here(self, kind: str, text: str) -> Any:
        return build(self._xgrammar_compiler(), kind, text)

    def _load(self, serialized: str) -> Any:
        import xgrammar as xgr

        self._xgrammar_compiler()
        return xgr.CompiledGrammar.deserialize_json(serialized, self._info)

    def _count(self, seconds: float, refused: bool) -> None:
        with self._lock:
            self.compile_seconds += seconds
            self.refusals += refused

    def _settled(self, key: tuple[str, str], future: Future[Any]) -> None:
        """A compile ended: cache its grammar (evicting the least recently used past the byte
        budget) or remember why it was refused. (The future is not captured by its own
        callback: an evicted grammar must be freed as soon as nothing holds it.)"""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.compiled is not future:
                return
            error = future.exception()
            if error is not None:
                del self._cache[key]
                if isinstance(error, InvalidRequestError):
                    self._refused[_digest(key)] = (type(error), str(error))
                    while len(self._refused) > MAX_REFUSALS_KEPT:
                        self._refused.popitem(last=False)
                return
            compiled = future.result()
            self._alive[key] = compiled
            entry.nbytes = int(compiled.memory_size_bytes)
            self.cached_bytes += entry.nbytes
            for old_key in list(self._cache):  # least recently used first; compiling ones stay
                if self.cached_bytes <= self.cache_bytes:
                    break
                old = self._cache[old_key]
                if old.compiled.done():
                    del self._cache[old_key]
                    self.cached_bytes -= old.nbytes

    # -- any thread --------------------------------------------------------------------------
    def submit(self, spec: StructuredOutput) -> Future[Any]:
        """The future compiled grammar of `spec`: cached, already compiling, or queued now.
        Never blocks. It fails with `InvalidRequestError` (the spec does not compile, or costs
        more than the budget), `GrammarBusyError` (the queue is full) or `EngineClosedError`."""
        key = spec.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry.compiled
            compiled = self._alive.get(key)
            if compiled is not None:  # evicted, but a request still holds it
                entry = _Entry(Future(), int(compiled.memory_size_bytes))
                entry.compiled.set_result(compiled)
                self._cache[key] = entry
                self.cached_bytes += entry.nbytes
                return entry.compiled
            refused = self._refused.get(_digest(key))
            if refused is not None:
                failed: Future[Any] = Future()
                failed.set_exception(refused[0](refused[1]))
                return failed
            entry = self._cache[key] = _Entry(Future())
            self.misses += 1
        entry.compiled.add_done_callback(lambda f: self._settled(key, f))
        try:
            self._pool.submit(Job(key[0], key[1], entry.compiled))
        except Exception as e:
            with self._lock:
                self.refusals += isinstance(e, GrammarBusyError)
            settle(entry.compiled, error=e)
        return entry.compiled

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec`, waiting (in this thread, never the step thread) at
        most `budget.wait_s`. Raises what `submit`'s future holds."""
        try:
            return self.submit(spec).result(self.budget.wait_s)
        except FutureTimeout:
            raise GrammarBusyError(
                f"the {spec.key[0]} constraint did not compile within "
                f"{self.budget.wait_s:g} s (the grammar wait timeout); retry later"
            ) from None

    def state_for(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for one request (compiling `spec` if it is new). A request counts as
        a cache hit when an earlier request already used the grammar, so compiling ahead
        (`submit`, for the same request) is not a hit."""
        import xgrammar as xgr

        compiled = self.compile(spec)
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self.hits += entry.used
                entry.used = True
        return GrammarState(self, xgr.GrammarMatcher(compiled))

    # -- the step thread ------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, states: list[GrammarState], rows: list[int]) -> None:
        """Set to -inf, in place, every token `states[i]` cannot take next in `logits[rows[i]]`:
        one bitmask for the batch, filled for these rows in one call."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        need = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < need:
            self._bitmask = xgr.allocate_token_bitmask(max(need, 8), self.vocab_size)
        bitmask = self._bitmask
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
        if logits.device.type != "cpu":
            xgr.apply_token_bitmask_inplace(
                logits, bitmask[:need].to(logits.device, non_blocking=True), indices=rows
            )
        elif logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows, backend="cpu")
        else:  # float64: xgrammar's CPU kernel takes 32- and 16-bit floats only
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows, backend="torch_native")
