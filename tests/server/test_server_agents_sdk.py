"""The OpenAI Agents SDK, unchanged, against `shoal serve` over its default Responses API: a
function-tool agent for two turns, once resending the whole conversation (its default) and
once chaining responses (`auto_previous_response_id`), where every request after the first
reuses the chain's KV. Tracing is off (its uploads go to OpenAI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, Field
from server_harness import LiveServer
from server_tiny_model import build_tiny_model

set_tracing_disabled(True)


class Sum(BaseModel):
    total: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def live(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    model = build_tiny_model(tmp_path_factory.mktemp("agents-model"), max_positions=4096)
    return start_server(engine={"model": str(model)})


def _agent(live: LiveServer, calls: list[tuple[int, int]]) -> Agent[Any]:
    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    # The first request must call the tool and the answer must be a `Sum`: the grammar sees
    # to both (the random model could not), so every response completes. After a tool call
    # the SDK resets tool_choice, and the model may call again or answer.
    settings = ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=160
    )
    return Agent(
        name="adder",
        instructions="Add the numbers with the add tool, then answer.",
        tools=[add],
        model=OpenAIResponsesModel(live.model, client),
        model_settings=settings,
        output_type=Sum,
    )


async def test_two_turns_resending_the_conversation(live: LiveServer) -> None:
    calls: list[tuple[int, int]] = []
    agent = _agent(live, calls)
    config = RunConfig(tracing_disabled=True)
    first = await Runner.run(agent, "What is 2 + 3?", run_config=config)
    second = await Runner.run(
        agent,
        [*first.to_input_list(), {"role": "user", "content": "And 4 + 4?"}],
        run_config=config,
    )
    assert len(calls) == 2  # one tool call per turn, run by the SDK
    for result in (first, second):
        assert isinstance(result.final_output, Sum)
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
        assert kinds[-1] == "message_output_item"
    assert all(r.response_id for r in first.raw_responses + second.raw_responses)


async def test_two_turns_chaining_responses(live: LiveServer) -> None:
    calls: list[tuple[int, int]] = []
    agent = _agent(live, calls)
    config = RunConfig(tracing_disabled=True)
    first = await Runner.run(
        agent, "What is 2 + 3?", run_config=config, auto_previous_response_id=True
    )
    second = await Runner.run(
        agent,
        "And 4 + 4?",
        run_config=config,
        previous_response_id=first.last_response_id,
        auto_previous_response_id=True,
    )
    assert len(calls) == 2 and isinstance(second.final_output, Sum)
    responses = first.raw_responses + second.raw_responses
    assert len(responses) == 4  # tool call, answer; tool call, answer
    cached = [r.usage.input_tokens_details.cached_tokens for r in responses]
    assert all(c > 0 for c in cached[1:]), cached  # each request continues the chain
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    last = client.responses.retrieve(str(second.last_response_id))
    assert last.previous_response_id == responses[2].response_id
    kinds = [i.type for i in client.responses.input_items.list(last.id, order="asc").data]
    assert kinds.count("function_call") == 2 and kinds.count("function_call_output") == 2
