"""How a `StructuredOutput` becomes an xgrammar grammar: one function, `build`, used alike by the
compile workers (which try a spec within its budgets) and by the engine's own compile, so that
what a worker proved affordable is exactly what the engine then compiles.

Two policies apply to every JSON schema, in answers and in structural tags alike:
- no free whitespace (`{"a": 1, "b": [2]}` style): a small model can otherwise spend its budget
  on blanks;
- `_tamed`: bounds a small model needs that JSON Schema lacks (below).
"""

from __future__ import annotations

import json
import re
from typing import Any

# xgrammar's C++ errors start with a timestamp and a source location; users need the rest.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_DATA = {"enum", "const", "default", "examples"}  # values, not schemas
INT64 = 2**63 - 1


def message(e: BaseException) -> str:
    """An xgrammar error as a user reads it."""
    return _LOCATION.sub("", str(e).strip()).strip()


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


def build(compiler: Any, kind: str, text: str) -> Any:
    """The compiled grammar of a spec's key (`StructuredOutput.key`: its kind and text).
    Raises what xgrammar raises for a spec it cannot compile."""
    if kind == "json":
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
        choices = " | ".join(json.dumps(c) for c in json.loads(text))
        return compiler.compile_grammar(f"root ::= {choices}")
    if kind == "grammar":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(json.dumps(_compact(json.loads(text))))


def admits_output(compiled: Any) -> bool:
    """Whether an output can start at all: some token other than a stop token is allowed
    first. A grammar that matches nothing (a `$ref` that only refers to itself, an empty
    `anyOf`) would otherwise end every request at once with an empty answer."""
    import numpy as np
    import xgrammar as xgr

    info = compiled.tokenizer_info
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].numpy().view(np.uint32).copy()
    for token in info.stop_token_ids:
        words[token // 32] &= ~np.uint32(1 << (token % 32))
    return bool(words.any())
