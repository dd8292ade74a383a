"""Bad input raises typed errors (shoal.errors) and leaves the engine untouched."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from shoal.config import EngineConfig
from shoal.engine.llm_engine import Engine
from shoal.errors import (
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    ShoalError,
)

SMALL_KV = 8 << 20


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def engine(tiny) -> Engine:
    return Engine(EngineConfig(model=str(tiny), dtype="float64", kv_cache_bytes=SMALL_KV))


def assert_untouched(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.pool.num_free == engine.pool.num_blocks


def test_error_hierarchy():
    assert issubclass(PromptTooLongError, InvalidRequestError)
    assert issubclass(InvalidRequestError, ShoalError)
    assert issubclass(InvalidRequestError, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": 2.5},
        {"temperature": -0.01},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": -0.5},
        {"top_k": -1},
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"logprobs": -1},
        {"logprobs": 21},
    ],
)
def test_bad_sampling_params_raise_at_construction(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"max_tokens": 1}, {"logprobs": 20}],
)
def test_edge_values_are_valid(kwargs):
    SamplingParams(**kwargs)


def test_params_broken_after_construction_are_rejected_at_submit(engine):
    sp = SamplingParams()
    sp.top_p = 0.0
    with pytest.raises(InvalidRequestError):
        engine.add_request([5, 6], sp)
    assert_untouched(engine)


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError):
        engine.add_request([], SamplingParams())
    assert_untouched(engine)


def test_empty_string_prompt_with_a_tokenizer(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama", tokenizer=True)), dtype="float64", kv_cache_bytes=SMALL_KV
    )
    with pytest.raises(InvalidRequestError):
        llm.generate([""], SamplingParams(max_tokens=2))
    assert_untouched(llm.engine)


def test_prompt_too_long(tiny):
    engine = Engine(
        EngineConfig(model=str(tiny), dtype="float64", kv_cache_bytes=SMALL_KV, max_model_len=32)
    )
    for n in (32, 33, 500):
        with pytest.raises(PromptTooLongError):
            engine.add_request([7] * n, SamplingParams(max_tokens=1))
    assert_untouched(engine)
    # One token shorter fits: there is room to generate exactly one token.
    engine.add_request(list(range(5, 36)), SamplingParams(max_tokens=10), request_id="fits")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 1


def test_prompt_over_the_models_own_limit(engine):
    assert engine.max_model_len == 512  # the tiny config's max_position_embeddings
    with pytest.raises(PromptTooLongError):
        engine.add_request([7] * 512, SamplingParams(max_tokens=1))
    assert_untouched(engine)


@pytest.mark.parametrize("bad", [[5, 320], [-1], [5, 1000000], ["5"], [5, 6.0], [True, 2**70]])
def test_token_ids_out_of_vocab(engine, bad):
    with pytest.raises(InvalidRequestError):
        engine.add_request(bad, SamplingParams())
    assert_untouched(engine)


def test_string_prompt_without_a_tokenizer(engine, tiny):
    with pytest.raises(InvalidRequestError):
        engine.add_request("hello", SamplingParams())
    llm = LLM(str(tiny), dtype="float64", kv_cache_bytes=SMALL_KV)
    with pytest.raises(InvalidRequestError):
        llm.chat([{"role": "user", "content": "hi"}])
    assert_untouched(llm.engine)


def test_request_larger_than_the_whole_pool_is_rejected_at_submit(tiny):
    engine = Engine(
        EngineConfig(model=str(tiny), dtype="float64", block_size=4, num_blocks=4)
    )  # 16 tokens in all
    with pytest.raises(PromptTooLongError, match="blocks"):
        engine.add_request(list(range(5, 15)), SamplingParams(max_tokens=7))  # 17 tokens
    with pytest.raises(PromptTooLongError):
        engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=1))
    assert_untouched(engine)
    # Exactly the whole pool is fine, even beside another request (preemption makes room).
    engine.add_request(list(range(5, 15)), SamplingParams(max_tokens=6, ignore_eos=True), "a")
    engine.add_request(list(range(20, 30)), SamplingParams(max_tokens=6, ignore_eos=True), "b")
    done = {}
    for _ in range(500):
        done |= {o.request_id: o for o in engine.step() if o.finished}
        if len(done) == 2:
            break
    assert {o.finish_reason for o in done.values()} == {"length"}
    assert all(len(o.token_ids) == 6 for o in done.values())
    assert engine.pool.num_free == 4


def test_duplicate_request_id(engine):
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(InvalidRequestError):
        engine.add_request([8, 9], SamplingParams(max_tokens=2), request_id="x")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7]]
    # Once finished, the id is free again.
    engine.add_request([8, 9], SamplingParams(max_tokens=2), request_id="x")


def test_abort_of_an_unknown_or_not_yet_submitted_id_is_ignored(engine):
    """Regression: an abort queued before the request with that id was submitted crashed."""
    engine.abort("nobody")
    engine.abort("later")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "later")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason, len(o.token_ids)) for o in outs] == [
        ("later", "length", 3)
    ]
    assert_untouched(engine)


def test_abort_of_a_running_request(engine):
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "r")
    engine.step()
    engine.step()
    engine.abort("r")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "abort")]
    assert len(outs[0].token_ids) == 2
    engine.abort("r")  # a second abort of a finished request does nothing
    assert_untouched(engine)


def test_closed_engine_takes_no_requests(engine):
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.add_request([5], SamplingParams())


def test_queue_full(tiny):
    engine = Engine(
        EngineConfig(model=str(tiny), dtype="float64", kv_cache_bytes=SMALL_KV, max_waiting=2)
    )
    engine.add_request([5], SamplingParams(max_tokens=1))
    engine.add_request([6], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        engine.add_request([7], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"dtype": "int8"},
        {"min_batch_size": 0},
        {"batch_wait_s": -1.0},
        {"backend": "tpu"},
        {"num_speculative_tokens": -1},
        {"prompt_lookup_min": 0},
        {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
        {"num_speculative_tokens": 4, "backend": "mlx"},
    ],
)
def test_bad_engine_config(kwargs):
    with pytest.raises(InvalidRequestError):
        EngineConfig(**kwargs)


def test_generate_needs_one_params_per_prompt(tiny):
    llm = LLM(str(tiny), dtype="float64", kv_cache_bytes=SMALL_KV)
    with pytest.raises(InvalidRequestError):
        llm.generate([[5], [6]], [SamplingParams(), SamplingParams(), SamplingParams()])
    assert_untouched(llm.engine)


def test_huge_text_is_refused_before_tokenizing(tiny_model_dir, monkeypatch):
    """A text longer than any max_model_len tokens could cover fails at once, untokenized."""
    engine = Engine(model=str(tiny_model_dir("llama", tokenizer=True)), dtype="float64")
    bound = engine.inputs.max_prompt_bytes
    assert 0 < bound < 10**6
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or [5])
    with pytest.raises(PromptTooLongError, match="bytes long"):
        engine.add_request("w5 " * bound, SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError):
        engine.apply_chat_template([{"role": "user", "content": "w5 " * bound}])
    assert calls == []
    engine.add_request("w5 w6", SamplingParams(max_tokens=1))  # a normal prompt still encodes
    assert calls == [1]


@pytest.mark.parametrize("sid", ["", "x" * 257, 7])
def test_bad_session_ids(engine, sid):
    with pytest.raises(InvalidRequestError, match="session_id"):
        engine.add_request([5, 6], SamplingParams(max_tokens=1), session_id=sid)
