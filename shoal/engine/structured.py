"""Constrained decoding through xgrammar: compiled grammars, per-sequence matchers, the bitmask.

`Grammars` is one engine's: the tokenizer's vocabulary is read once (on the first constrained
request), each distinct `StructuredOutput` is compiled once and kept in a bounded LRU cache
keyed by its (kind, spec), in the caller's thread (`InputProcessor.process`, or ahead of it
`Engine.check_structured`): never on the step thread. A spec that does not compile raises
`InvalidRequestError` before anything is queued.

Each constrained `Sequence` holds a `GrammarState` (in `Sequence.grammar`, untyped so the
sequence stays torch-free). On the step thread the sampler asks `Grammars.mask` to fill one
bitmask row per constrained sequence in one batched call and to set every token the grammar
cannot take next to -inf; unconstrained rows are never touched, and a step without
constrained rows never gets here. The output processor feeds each appended token to the
state, so the matcher has always accepted exactly `output_token_ids`: a preempted request is
recomputed from its kept tokens without sampling them again, so nothing needs rolling back.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from shoal.errors import InvalidRequestError
from shoal.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

# xgrammar's C++ errors start with a timestamp and a source location; users need the rest.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip()).strip()


_DATA = {"enum", "const", "default", "examples"}  # values, not schemas
INT64 = 2**63 - 1


def _tamed(node: Any) -> Any:
    """A schema as shoal compiles it, two bounds a small model needs that JSON Schema lacks:

    - a string with `minLength`/`maxLength` becomes the same bounds in a pattern,
      `^.{lo,hi}$` (without escapes): xgrammar (0.2.8 still, its issue 286) lets a
      length-bounded string hold raw control characters, which no JSON parser accepts;
    - an integer without a bound stays within 64 bits, as nearly every consumer stores it:
      unbounded, a sampled model can write digits until `max_tokens` runs out.
    Used on schemas and on the schemas inside structural tags alike."""
    if isinstance(node, list):
        return [_tamed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA else _tamed(v) for k, v in node.items()}
    if out.get("type") == "string" and not {"pattern", "format", *_DATA} & out.keys():
        lo, hi = out.pop("minLength", None), out.pop("maxLength", None)
        if lo is not None or hi is not None:
            out["pattern"] = f"^.{{{lo or 0},{'' if hi is None else hi}}}$"
    if out.get("type") == "integer" and not _DATA & out.keys():
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = INT64
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = -INT64
    return out


def _compact(node: Any) -> Any:
    """A structural tag with each JSON schema in it as the grammar of that schema without free
    whitespace, the policy `json` specs compile under: one `{"a": 1, "b": [2]}` style for all
    the JSON shoal constrains (xgrammar's own json_schema format allows any whitespace)."""
    if isinstance(node, list):
        return [_compact(x) for x in node]
    if not isinstance(node, dict):
        return node
    schema = node.get("json_schema")
    if node.get("type") == "json_schema" and isinstance(schema, dict):
        if node.get("style", "json") != "json" or node.get("any_order"):
            return node  # formats this policy does not cover compile as they are
        import xgrammar as xgr

        text = json.dumps(_tamed(schema))
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _compact(v) for k, v in node.items()}


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
    compiled: Future[Any]  # set once, by the thread that compiles
    used: bool = False  # a request has had a matcher of it


class Grammars:
    """Compiles specs for one tokenizer (cached) and masks logits for constrained rows.
    `misses` counts compiles, `hits` requests served by a grammar compiled before them."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_cached: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which can exceed the tokenizer's
        self.stop_token_ids = stop_token_ids
        self.max_cached = max_cached
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, step thread only
        self._bitmask: torch.Tensor | None = None

    def _xgrammar_compiler(self) -> Any:
        """Built on first use: reading a 49k vocabulary takes a fraction of a second, which
        engines that never see a constrained request should not pay."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _build(self, spec: StructuredOutput) -> Any:
        compiler = self._xgrammar_compiler()
        kind, text = spec.key
        if kind == "json":
            # No free whitespace: a small model can otherwise spend its budget on blanks.
            schema = _tamed(json.loads(text))
            return compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True
            )
        if kind == "json_object":
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            assert spec.choice is not None
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in spec.choice)
            )
        if kind == "grammar":
            return compiler.compile_grammar(text)
        return compiler.compile_structural_tag(json.dumps(_compact(json.loads(text))))

    def _entry(self, spec: StructuredOutput) -> _Entry:
        key = spec.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
            entry = self._cache[key] = _Entry(Future())
            self.misses += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        try:
            entry.compiled.set_result(self._build(spec))
        except Exception as e:
            with self._lock:
                if self._cache.get(key) is entry:
                    del self._cache[key]
            entry.compiled.set_exception(
                InvalidRequestError(f"the {key[0]} constraint does not compile: {_message(e)}")
            )
        return entry

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec`, from the cache or built now (any thread but the step
        thread). Raises `InvalidRequestError` with the library's reason when it cannot compile.
        Another thread compiling the same spec is waited for, not repeated."""
        return self._entry(spec).compiled.result()

    def state_for(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for one request (compiling `spec` if it is new). A request counts as
        a cache hit when an earlier request already used the grammar, so compiling ahead
        (`compile`, for the same request) is not a hit."""
        import xgrammar as xgr

        entry = self._entry(spec)
        compiled = entry.compiled.result()
        with self._lock:
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
