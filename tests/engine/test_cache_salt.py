"""`cache_salt` on a tiny float64 model: a salted session keeps its salt on disk and in the
shared folder, so after a restart, or on another engine, only a turn with the same salt reuses
its KV; outputs stay those of a run without any cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal import LLM, Engine, SamplingParams
from shoal.engine.hashing import Salt
from shoal.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i) % 200 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


def make(model: Path, **kw: Any) -> Engine:
    return Engine(model=str(model), dtype="float64", block_size=4, num_blocks=128, **kw)


def run(engine: Engine, prompt: list[int], **kw: Any) -> tuple[list[int], int]:
    rid = engine.add_request(prompt, GREEDY, **kw)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.num_cached_tokens


def test_a_salted_session_is_restored_for_its_salt_only(model: Path, tmp_path: Path) -> None:
    plain = run(make(model, enable_prefix_caching=False), PROMPT)[0]
    first = make(model, cache_dir=str(tmp_path))
    assert run(first, PROMPT, session_id="s", cache_salt="a") == (plain, 0)
    first.close()  # the session's manifest and blocks go to disk, with salt a
    again = make(model, cache_dir=str(tmp_path))
    longer = PROMPT + plain + [5, 6]
    expected = run(make(model, enable_prefix_caching=False), longer)[0]
    other = run(again, longer, session_id="s", cache_salt="b")
    assert other == (expected, 0)  # salt b is told of nothing salt a computed
    longest = longer + expected + [7]
    # salt a again: its full blocks come back from disk (the session holds b's turn now)
    tokens, cached = run(again, longest, session_id="s", cache_salt="a")
    assert tokens == run(make(model, enable_prefix_caching=False), longest)[0]
    assert cached == (len(PROMPT) + len(plain) - 1) // 4 * 4
    with pytest.raises(InvalidRequestError):
        again.add_request(PROMPT, GREEDY, cache_salt="")


def test_the_shared_folder_keeps_a_sessions_salt(model: Path, tmp_path: Path) -> None:
    tier = str(tmp_path / "tier")
    one, two = make(model, session_tier_dir=tier), make(model, session_tier_dir=tier)
    salt = Salt.of("tenant-a", shared_blocks=2)  # as the server passes a tenant's salt
    out = run(one, PROMPT, session_id="s", cache_salt=salt)[0]
    one.sessions.flush()  # the turn's copy has landed
    longer = PROMPT + out + [9]
    assert run(two, longer, session_id="s", cache_salt=Salt.of("tenant-b", 2))[1] == 8
    three = make(model, session_tier_dir=tier)
    assert run(three, longer, session_id="s", cache_salt=salt)[1] > len(PROMPT)


def test_llm_generate_shares_cached_blocks_only_within_a_salt(model: Path) -> None:
    llm = LLM(str(model), dtype="float64", block_size=4, num_blocks=128)
    (first,) = llm.generate([PROMPT], GREEDY, cache_salt="a")
    (other,) = llm.generate([PROMPT], GREEDY, cache_salt="b")
    (same,) = llm.generate([PROMPT], GREEDY, cache_salt="a")
    (unsalted,) = llm.generate([PROMPT], GREEDY)
    assert (other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens == 36
    assert first.token_ids == other.token_ids == same.token_ids == unsalted.token_ids
