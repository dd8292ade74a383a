"""`LLM(..., backend="mlx")` on a tiny llama GGUF: the public API over the MLX backend."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from mlx_helpers import run

from shoal import LLM, SamplingParams
from shoal.backends.mlx import BlockPoolBatchEngine
from shoal.engine.block_pool import BlockPool
from shoal.errors import InvalidRequestError
from shoal.sampling_params import StructuredOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def llm(tiny_gguf: Path) -> Iterator[LLM]:
    with LLM(str(tiny_gguf), backend="mlx", num_blocks=NUM_BLOCKS) as llm:
        yield llm


@pytest.fixture(autouse=True)
def whole_pool(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves the shared LLM idle, its sessions dropped and its pool whole."""
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        assert not llm.engine.has_unfinished_requests()
        llm.sessions.clear()
        assert llm.engine.pool.num_free == NUM_BLOCKS


def block_engine(llm: LLM) -> BlockPoolBatchEngine:
    """The backend's own engine on the same model (no stop tokens: it runs to max_tokens)."""
    core = llm.engine.core  # type: ignore[attr-defined]
    return BlockPoolBatchEngine(
        core.model,
        core.tokenizer,
        BlockPool(64, core.spec.block_tokens),
        core.spec,
        eos_token_ids=[],
    )


def test_greedy_generate_and_chat_equal_the_backends_own_engine(llm: LLM) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts: list[Any] = ["The capital of France is", [5, 6, 7, 8], llm.apply_chat_template(chat)]
    outs = llm.generate(prompts, GREEDY)
    (chatted,) = llm.chat(chat, GREEDY)
    own = block_engine(llm)
    uids = [
        own.submit(f"agent-{i}", p, max_tokens=GREEDY.max_tokens) for i, p in enumerate(prompts)
    ]
    done = run(own)
    for out, uid in zip(outs, uids, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == done[uid].token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert chatted.token_ids == outs[2].token_ids and chatted.text == outs[2].text
    assert len(llm.sessions) == 0  # requests without a session leave no KV behind
    assert llm.stats().num_generated_tokens >= 4 * GREEDY.max_tokens


def test_each_step_reports_the_new_token_so_callers_can_stream(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request("Once upon a time", GREEDY)
    seen = []
    while engine.has_unfinished_requests():
        seen += [out for out in engine.step() if out.request_id == rid]
    counts = [len(out.token_ids) for out in seen]
    assert counts == list(range(1, GREEDY.max_tokens + 1))
    assert all(a.text == b.text[: len(a.text)] for a, b in pairwise(seen))
    assert [out.finish_reason for out in seen][-2:] == [None, "length"]


def test_stop_strings_and_stop_token_ids_end_requests_as_on_torch(llm: LLM) -> None:
    (full,) = llm.generate("Hello", GREEDY)
    cut = full.text[len(full.text) // 2 :][:3]
    (stopped,) = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, stop=cut))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(cut)]
    token = full.token_ids[4]
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[token])
    (by_id,) = llm.generate("Hello", params)
    first = full.token_ids.index(token)
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: first + 1]


def test_sampling_parameters_are_honoured(llm: LLM) -> None:
    (greedy,) = llm.generate("Paris is", GREEDY)
    # Filters that leave only the most likely token make sampling greedy: they are applied.
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        params = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True, seed=1, **kw)
        assert llm.generate("Paris is", params)[0].token_ids == greedy.token_ids, kw
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate("Paris is", seeded)[0].token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["Paris is", "Rome is"], [seeded, other])
    assert batch[0].token_ids == alone != greedy.token_ids  # its own key, not the batch's
    for seed in (-(2**63), 2**64 - 1):  # the whole range the API (and torch) accept
        assert len(llm.generate("Paris", SamplingParams(max_tokens=2, seed=seed))[0].token_ids)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    (scored,) = llm.generate("Paris is", params)
    assert scored.logprobs is not None and scored.top_logprobs is not None
    for token, lp, top in zip(scored.token_ids, scored.logprobs, scored.top_logprobs, strict=True):
        assert len(top) == 3 and max(top, key=top.__getitem__) == token
        assert lp == pytest.approx(top[token]) and lp < 0


def test_invalid_requests_raise_typed_errors(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[5, 10**6]], GREEDY)
    with pytest.raises(InvalidRequestError, match="session_id"):
        llm.generate("hi", GREEDY, session_id="")
    with pytest.raises(InvalidRequestError, match="dtype"):
        LLM(llm.engine.config.model, backend="mlx", dtype="float16")
    with pytest.raises(InvalidRequestError, match="backend"):
        LLM(backend="tpu")
    choice = StructuredOutput(choice=["yes", "no"])
    with pytest.raises(InvalidRequestError, match="not supported on this backend"):
        llm.generate("hi", SamplingParams(max_tokens=4, structured=choice))
    with pytest.raises(InvalidRequestError, match="not supported on this backend"):
        llm.engine.compile_structured(choice)


def test_pool_exhaustion_reaches_the_caller_as_a_finish_reason(tiny_gguf: Path) -> None:
    with LLM(str(tiny_gguf), backend="mlx", num_blocks=4) as small:  # 64 tokens in all
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        outs = small.generate([[7] * 20, [9] * 20], params)
        assert sorted(o.finish_reason or "" for o in outs) == ["length", "pool_exhausted"]
        short = next(o for o in outs if o.finish_reason == "pool_exhausted")
        assert 0 < len(short.token_ids) < 40
        assert small.engine.pool.num_free == 4


def test_sessions_across_turns_and_an_llm_restart(tiny_gguf: Path, tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Tell me about Paris."}]
    kw: dict[str, Any] = {"backend": "mlx", "cache_dir": str(tmp_path), "num_blocks": 64}
    with LLM(str(tiny_gguf), **kw) as llm:
        (first,) = llm.chat(chat, GREEDY, session_id="agent")
        chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
        (second,) = llm.chat(chat, GREEDY, session_id="agent")
        assert second.num_cached_tokens >= len(first.prompt_token_ids)
        assert second.token_ids == llm.chat(chat, GREEDY)[0].token_ids  # recomputed: the same
        assert [s.session_id for s in llm.sessions] == ["agent"]
    with LLM(str(tiny_gguf), **kw) as again:
        info = again.sessions["agent"]
        assert (info.state, info.on_disk) == ("spilled", True)
        chat += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "Ok."}]
        (third,) = again.chat(chat, GREEDY, session_id="agent")
        assert third.num_cached_tokens >= len(second.prompt_token_ids)
        assert again.stats().disk_reads == 1
        assert third.token_ids == again.chat(chat, GREEDY)[0].token_ids
        assert again.sessions.drop("agent") and len(again.sessions) == 0


def test_generate_command_runs_the_mlx_backend_without_torch(llm: LLM) -> None:
    """`shoal generate --backend mlx` in a fresh process where torch cannot be imported."""
    model = llm.engine.config.model
    code = (
        "import sys; sys.modules['torch'] = None; from shoal.cli import main; "
        f"sys.exit(main(['generate', 'Hi there', '--backend', 'mlx', '--model', {model!r}, "
        "'--max-tokens', '5', '--json']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    params = SamplingParams(max_tokens=5, temperature=0)
    (want,) = llm.chat([{"role": "user", "content": "Hi there"}], params)
    assert (line["text"], line["finish_reason"]) == (want.text, want.finish_reason)
