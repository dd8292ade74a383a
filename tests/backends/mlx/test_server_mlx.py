"""A live server on the MLX backend (`EngineConfig(backend="mlx")`, what `shoal serve --backend
mlx` builds), answered through the official `openai` SDK."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import LiveServer, wait_pool_whole

from shoal.backends.mlx.adapter import MLXEngine

MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def live(tiny_gguf: Path, start_server: Callable[..., LiveServer]) -> LiveServer:
    return start_server(engine={"model": str(tiny_gguf), "backend": "mlx", "num_blocks": 128})


def test_chat_answers_the_same_streamed_or_not(live: LiveServer) -> None:
    assert isinstance(live.state.engine, MLXEngine)
    client = live.client()
    kw = {"model": live.model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(deltas) > 1  # streamed as it was generated, not all at the end
    assert "".join(deltas) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert wait_pool_whole(live)


def test_a_session_header_reuses_the_previous_turn(live: LiveServer) -> None:
    client = live.client()
    kw = {"model": live.model, "max_tokens": 6, "temperature": 0}
    headers = {"X-Session-Id": "mlx-agent"}
    first = client.chat.completions.create(messages=MESSAGES, extra_headers=headers, **kw)  # type: ignore[call-overload]
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}]
    turn.append({"role": "user", "content": "And of Italy?"})
    second = client.chat.completions.create(messages=turn, extra_headers=headers, **kw)  # type: ignore[call-overload]
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= first.usage.prompt_tokens
    assert live.state.engine.session_info("mlx-agent") is not None
    assert live.state.engine.drop_session("mlx-agent")


def test_an_invalid_parameter_is_a_400_naming_it(live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(
            model=live.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=5.0,
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature"  # type: ignore[index]


def test_metrics_name_the_backend(live: LiveServer) -> None:
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    (info,) = [ln for ln in text.splitlines() if ln.startswith("shoal_engine_info{")]
    assert 'backend="mlx"' in info and 'prefix_caching="false"' in info
