"""Constrained decoding in the continuous batch, on a tiny random model with a real byte-level
BPE tokenizer: whatever the random weights prefer, a constrained output always parses, and
unconstrained rows in the same batch come out exactly as they would alone."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from shoal import LLM, SamplingParams
from shoal.engine.grammar_pool import GrammarBusyError
from shoal.engine.grammar_worker import GrammarBudget
from shoal.engine.input_processor import InputProcessor
from shoal.engine.structured import Grammars
from shoal.errors import InvalidRequestError
from shoal.sampling_params import StructuredOutput

# Bounded on every side, so even a random model finishes it within a few dozen tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags"],
}
PROMPTS = ["The quick brown fox", "Hello world, this is", "What is the capital", "Batches of"]


def _llm(path: Path, **kw: Any) -> LLM:
    kw.setdefault("num_blocks", 256)
    return LLM(str(path), **kw)


def _greedy(spec: StructuredOutput | None, max_tokens: int = 96, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured=spec, **kw)


def _check(spec: StructuredOutput, text: str) -> None:
    """`text` is a complete output of `spec`."""
    if spec.json is not None:
        assert isinstance(spec.json, dict)
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice


def _whole(llm: LLM) -> bool:
    engine = llm.engine
    return not engine.has_unfinished_requests() and engine.pool.num_free == engine.pool.num_blocks


SPECS = [
    StructuredOutput(json=PERSON),
    StructuredOutput(json_object=True),
    StructuredOutput(regex=r"[a-c]{2,4}@(x|y)\.com"),
    StructuredOutput(choice=["yes", "no", "maybe not"]),
]


def test_constrained_rows_parse_and_free_rows_are_untouched(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model)
    alone = llm.generate(PROMPTS, _greedy(None), use_tqdm=False)
    params = [_greedy(None) for _ in PROMPTS] + [_greedy(s) for s in SPECS]
    outs = llm.generate(PROMPTS + PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs[: len(PROMPTS)]] == [o.token_ids for o in alone]
    for spec, out in zip(SPECS, outs[len(PROMPTS) :], strict=True):
        assert out.finish_reason == "stop", out.text
        _check(spec, out.text)
    assert _whole(llm)


def test_sampled_and_float64_rows_parse_too(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model, dtype="float64")  # the mask's path for non-32-bit logits
    params = [
        SamplingParams(max_tokens=96, temperature=1.0, top_p=0.9, seed=s, structured=SPECS[0])
        for s in range(6)
    ]
    first = llm.generate(PROMPTS[:1] * 6, params, use_tqdm=False)
    again = llm.generate(PROMPTS[:1] * 6, params, use_tqdm=False)
    for a, b in zip(first, again, strict=True):
        assert a.token_ids == b.token_ids  # a seed still makes a request reproducible
        assert a.finish_reason == "stop"
        _check(SPECS[0], a.text)
    assert len({o.text for o in first}) > 1
    assert _whole(llm)


def test_a_spec_that_does_not_compile_is_refused_before_queueing(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model)
    bad = [
        StructuredOutput(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
        StructuredOutput(json={"type": "integer", "minimum": 5, "maximum": 1}),
        StructuredOutput(json="{not json"),
        StructuredOutput(regex="(a"),
        StructuredOutput(grammar="root ::= missing_rule"),
        StructuredOutput(structural_tag={"type": "structural_tag", "format": {"type": "bogus"}}),
        StructuredOutput(json={"anyOf": []}),  # matches nothing: every answer would be empty
        StructuredOutput(json={"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}),
    ]
    for spec in bad:
        with pytest.raises(InvalidRequestError, match="does not compile"):
            llm.engine.add_request("Hello", _greedy(spec))
        with pytest.raises(InvalidRequestError, match="does not compile"):
            llm.engine.compile_structured(spec).result()
    assert _whole(llm)
    assert llm.generate("Hello", _greedy(SPECS[3]), use_tqdm=False)[0].text in SPECS[3].choice


def test_the_spec_itself_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput(json=PERSON, regex="a")
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutput(choice=[])
    with pytest.raises(InvalidRequestError, match="structured"):
        SamplingParams(structured={"json": PERSON})  # type: ignore[arg-type]
    # Property order is kept in the cache key: it is the order the output follows.
    a = StructuredOutput(json={"a": 1, "b": 2})
    assert a.key != StructuredOutput(json={"b": 2, "a": 1}).key
    assert a.key == StructuredOutput(json={"a": 1, "b": 2}).key


def test_out_of_tokens_ends_with_length_and_frees_the_matcher(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model)
    engine = llm.engine
    long_text = {"type": "string", "minLength": 200}
    rid = engine.add_request("Hello", _greedy(StructuredOutput(json=long_text), max_tokens=8))
    seq = engine._requests.get(rid)  # the engine's own record, to watch its matcher go
    assert seq is not None
    assert seq.grammar is not None
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 8
    assert outs[-1].text.startswith('"')
    assert seq.grammar is None
    assert _whole(llm)


def test_unbounded_integers_stay_within_64_bits(tiny_chat_model: Path) -> None:
    """Sampled, a random model would write digits until max_tokens ran out."""
    llm = _llm(tiny_chat_model)
    spec = StructuredOutput(json={"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    params = [
        SamplingParams(max_tokens=96, temperature=1.0, seed=s, structured=spec) for s in range(8)
    ]
    for out in llm.generate(PROMPTS[:1] * 8, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        assert all(abs(n) < 2**63 for n in json.loads(out.text))


def test_ignore_eos_still_ends_when_the_output_is_complete(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model)
    (out,) = llm.generate("Hi", _greedy(SPECS[3], ignore_eos=True), use_tqdm=False)
    assert out.finish_reason == "stop" and out.text in SPECS[3].choice


def test_preempted_constrained_requests_stay_valid(tiny_chat_model: Path) -> None:
    """A pool too small for every request at once: the newest are preempted, recomputed from
    their kept tokens (never sampled again, so the matcher has nothing to undo), and come out
    exactly as they do in a roomy pool."""
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    bounded = [SPECS[0], SPECS[2]]  # outputs a random model must finish
    params = [_greedy(bounded[i % 2], max_tokens=96) for i in range(len(prompts))]
    roomy = _llm(tiny_chat_model).generate(prompts, params, use_tqdm=False)
    cramped = _llm(tiny_chat_model, num_blocks=32, block_size=4, max_num_batched_tokens=32)
    outs = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop"
        _check(bounded[i % 2], out.text)
    assert _whole(cramped)


def test_chunked_prefill_and_sessions(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model, max_num_batched_tokens=8)
    turn1 = " ".join(PROMPTS * 3)
    (a,) = llm.generate(turn1, _greedy(SPECS[0]), session_id="agent", use_tqdm=False)
    _check(SPECS[0], a.text)
    turn2 = llm.engine.encode(turn1) + a.token_ids + llm.engine.encode(" and then")
    (b,) = llm.generate(turn2, _greedy(SPECS[2]), session_id="agent", use_tqdm=False)
    assert b.num_cached_tokens > 0  # the session's KV was reused
    _check(SPECS[2], b.text)
    assert not llm.engine.has_unfinished_requests()


def test_compiled_once_per_spec(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model)
    llm.generate(PROMPTS, [_greedy(StructuredOutput(json=PERSON))] * 4, use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.grammar_cache_hits, stats.grammar_cache_misses) == (3, 1)
    # Compiling ahead for a request (as the server does, off its event loop) is no hit.
    choice = StructuredOutput(choice=["a", "b"])
    llm.engine.compile_structured(choice).result()
    llm.generate("Hi", _greedy(choice), use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.grammar_cache_hits, stats.grammar_cache_misses) == (3, 2)


def test_logprobs_are_the_models_own(tiny_chat_model: Path) -> None:
    llm = _llm(tiny_chat_model)
    spec = StructuredOutput(choice=["yes", "no"])
    (out,) = llm.generate("Hi", _greedy(spec, logprobs=3), use_tqdm=False)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert all(lp <= 0 and lp != float("-inf") for lp in out.logprobs)
    assert all(len(top) == 3 for top in out.top_logprobs)


def test_a_backend_without_grammars_refuses_constraints() -> None:
    inputs = InputProcessor(None, 32, 64, 64, 4, seeded=lambda s: None)
    with pytest.raises(InvalidRequestError, match="not supported on this backend"):
        inputs.process([1, 2], _greedy(SPECS[1]), None, 0, None)


@pytest.fixture
def grammars(tiny_chat_model: Path) -> Iterator[Callable[..., Grammars]]:
    """`grammars(cache_bytes=..., **budget)`: a `Grammars` for the tiny model, closed after."""
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    made: list[Grammars] = []

    def make(cache_bytes: int = 256 << 20, **budget: Any) -> Grammars:
        made.append(Grammars(tok, 320, [tok.eos_token_id], GrammarBudget(**budget), cache_bytes))
        return made[-1]

    yield make
    for g in made:
        g.close()


# Minutes to compile on any CPU (3,000 optional properties: about 4 minutes on a Zen 3 core).
SLOW = StructuredOutput(
    json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
)


def _enum(i: int, n: int = 1500) -> StructuredOutput:
    return StructuredOutput(json={"enum": [f"v{i}-{j:05d}-{'x' * 24}" for j in range(n)]})


def test_the_cache_is_bounded_by_bytes(grammars: Callable[..., Grammars]) -> None:
    one = grammars().compile(_enum(0)).memory_size_bytes
    g = grammars(cache_bytes=3 * one)
    held = g.compile(_enum(0))  # a request holds its grammar while it runs
    for i in range(1, 10):
        g.compile(_enum(i))
        assert g.cached_bytes <= 3 * one
    assert g.misses == 10
    # Evicted long ago, but still held: served again without compiling.
    assert g.compile(_enum(0)) is held and g.misses == 10
    g.compile(_enum(1))  # evicted and not held: compiled again
    assert g.misses == 11


def test_a_refusal_is_remembered(grammars: Callable[..., Grammars]) -> None:
    """A spec over budget is refused once; again it costs no compile. The slow spec takes
    minutes on any CPU, so a one-second budget refuses it whatever the machine."""
    g = grammars(timeout_s=1.0)
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="longer than 1 s to compile"):
            g.compile(SLOW)
    assert (g.misses, g.refusals) == (1, 1)
    assert g.compile(SPECS[3]) is not None  # the pool goes on


def test_a_request_waits_for_its_grammar_a_bounded_time(grammars: Callable[..., Grammars]) -> None:
    g = grammars(timeout_s=600.0, wait_s=0.5)
    with pytest.raises(GrammarBusyError, match=r"did not compile within 0\.5 s"):
        g.compile(SLOW)
