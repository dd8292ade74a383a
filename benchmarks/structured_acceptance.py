"""Issue 18's acceptance run on the bundled SmolLM2-135M (a script, not a test: minutes of CPU).

Starts `shoal serve` on 127.0.0.1 in a subprocess and, through the official SDKs:
1. sends `--requests` constrained chat requests over the 22 schemas of `structured_schemas.py`
   (nested objects, arrays, enums, required fields, bounded numbers), half streamed, all at once
   together with `--free` unconstrained ones, and validates every answer with `jsonschema`;
2. forces tool calls (OpenAI: a named function and `required`, streamed and not; Anthropic:
   `tool` and `any`) and validates every call's arguments against its tool's schema;
3. parses with the SDKs' own helpers: `chat.completions.parse(response_format=PydanticModel)`,
   `parsed_arguments` of a strict tool, Anthropic `tool_use` blocks;
4. runs a two-turn tool loop in a session (call, `tool` result, answer);
and prints the counts, and whether the pool was whole after 1-3 (no request left, no KV
block in use).

    .venv/bin/python benchmarks/structured_acceptance.py [--requests 200] [--free 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from collections import Counter
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
from serve_process import start_serve
from structured_schemas import ADD, SCHEMAS, TOOL_SCHEMAS, WEATHER, GetWeather, Person


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Invent {what}. Answer in JSON."}]


async def constrained(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[bool, str]:
    """One constrained request; (valid, what went wrong)."""
    what, schema = SCHEMAS[i % len(SCHEMAS)]
    kw: dict[str, Any] = {
        "model": model,
        "messages": ask(what),
        "max_tokens": 256,
        "temperature": 0.8,
        "seed": i,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    if i % 2:
        text, finish = "", None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        done = await client.chat.completions.create(**kw)
        text, finish = done.choices[0].message.content or "", done.choices[0].finish_reason
    try:
        jsonschema.validate(json.loads(text), schema)
    except Exception as e:
        return False, f"{what} ({finish}): {type(e).__name__}: {text[:120]!r}"
    return True, ""


async def free(client: openai.AsyncOpenAI, model: str, i: int) -> bool:
    done = await client.chat.completions.create(
        model=model, messages=ask(SCHEMAS[i % len(SCHEMAS)][0]), max_tokens=48, seed=i
    )
    return done.choices[0].finish_reason in ("stop", "length")


async def openai_tool(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[list[bool], str]:
    """One forced call request: (each call's arguments valid?, finish reason). A call cut
    short by max_tokens (finish reason length) is not a call: whole answers leave it out, and
    so does this count for streamed ones."""
    choice: Any = "required" if i % 2 else {"type": "function", "function": {"name": "add"}}
    kw: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"What is {i} plus {2 * i}? Also, weather in Oslo?"}
        ],
        "tools": [ADD, WEATHER],
        "tool_choice": choice,
        "parallel_tool_calls": i % 4 != 1,
        "max_tokens": 256,
        "temperature": 0.7,
        "seed": i,
    }
    calls: list[tuple[str, str]] = []
    if i % 4 >= 2:  # streamed: put the deltas back together
        parts: dict[int, list[str]] = {}
        finish = ""
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = parts.setdefault(d.index, ["", ""])
                if d.function and d.function.name:
                    entry[0] = d.function.name
                entry[1] += (d.function.arguments or "") if d.function else ""
        calls = [(n, a) for n, a in parts.values()]
        if finish == "length" and calls:
            calls.pop()
    else:
        done = await client.chat.completions.create(**kw)
        finish = done.choices[0].finish_reason
        calls = [
            (c.function.name, c.function.arguments)
            for c in done.choices[0].message.tool_calls or []
        ]
    return [valid_call(n, a) for n, a in calls], finish


def valid_call(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
    except Exception:
        return False
    return True


async def anthropic_tool(
    claude: anthropic.AsyncAnthropic, model: str, i: int
) -> tuple[list[bool], str]:
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in (ADD, WEATHER)
    ]
    choice = {"type": "any"} if i % 2 else {"type": "tool", "name": "get_weather"}
    msg = await claude.messages.create(
        model=model,
        max_tokens=256,
        messages=[{"role": "user", "content": f"Weather in city number {i}, and {i} + 1?"}],
        tools=tools,  # type: ignore[arg-type]
        tool_choice=choice,  # type: ignore[arg-type]
        extra_body={"temperature": 0.7},
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    return [valid_call(u.name, json.dumps(u.input)) for u in uses], str(msg.stop_reason)


def sdk_helpers(url: str, model: str) -> list[str]:
    """The SDKs' own parsing helpers; returns failures."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    failures = []
    person = client.chat.completions.parse(
        model=model,
        messages=ask("a person living in one of Paris, Tokyo, Lima, Oslo"),
        response_format=Person,
        max_tokens=128,
    )
    if not isinstance(person.choices[0].message.parsed, Person):
        failures.append("parse(response_format=Person)")
    tool = openai.pydantic_function_tool(GetWeather)
    weather = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=128,
    )
    calls = weather.choices[0].message.tool_calls or []
    if not calls or not isinstance(calls[0].function.parsed_arguments, GetWeather):
        failures.append("parse(tools=[pydantic_function_tool(GetWeather)])")
    return failures


def tool_loop(url: str, model: str) -> str:
    """Call, tool result, answer, in one session; returns how the answer ended."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    session = {"extra_headers": {"X-Session-Id": "acceptance-loop"}}
    turn: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 17 plus 25? Use the add tool."}
    ]
    first = client.chat.completions.create(
        model=model,
        messages=turn,
        tools=[ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        **session,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    args = json.loads(call.function.arguments)
    turn += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    second = client.chat.completions.create(
        model=model, messages=turn, tools=[ADD], max_tokens=64, temperature=0, **session
    )
    cached = (
        second.usage.prompt_tokens_details.cached_tokens
        if second.usage and second.usage.prompt_tokens_details
        else 0
    )
    return (
        f"call add({args}) -> {args['a'] + args['b']}; answer ({second.choices[0].finish_reason}, "
        f"{cached} prompt tokens from the session): {second.choices[0].message.content!r}"
    )


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


async def main_async(args: argparse.Namespace, url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=3600)
    claude = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    start = time.perf_counter()
    checked, answered = await asyncio.gather(  # all in the engine's batch at once
        asyncio.gather(*(constrained(client, model, i) for i in range(args.requests))),
        asyncio.gather(*(free(client, model, i) for i in range(args.free))),
    )
    elapsed = time.perf_counter() - start
    ok = sum(good for good, _ in checked)
    print(
        f"constrained: {ok}/{args.requests} parse and validate ({len(SCHEMAS)} schemas, "
        f"half streamed), with {sum(answered)}/{args.free} unconstrained alongside, "
        f"{elapsed:.0f} s"
    )
    for good, why in checked:
        if not good:
            print("  failed:", why)
    start = time.perf_counter()
    calls = await asyncio.gather(
        *(openai_tool(client, model, i) for i in range(args.tools)),
        *(anthropic_tool(claude, model, i) for i in range(args.tools // 2)),
    )
    flat = [ok for oks, _ in calls for ok in oks]
    ends = Counter(finish for _, finish in calls)
    print(
        f"forced tool calls: {sum(flat)}/{len(flat)} calls with valid arguments, from "
        f"{args.tools} OpenAI requests (half streamed) and {args.tools // 2} Anthropic ones; "
        f"answers ended {dict(ends)}; {time.perf_counter() - start:.0f} s"
    )
    failures = await asyncio.to_thread(sdk_helpers, url, model)
    print(f"SDK helpers: {'all parsed' if not failures else 'FAILED ' + ', '.join(failures)}")
    text = httpx.get(f"{url}/metrics").text
    left = sum(
        metric(text, f"shoal_{m}")
        for m in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used")
    )
    print(
        f"pool whole (no request left, no KV block in use): {left == 0}; grammar cache "
        f"{metric(text, 'shoal_grammar_cache_hits_total'):.0f} hits, "
        f"{metric(text, 'shoal_grammar_cache_misses_total'):.0f} compiles"
    )
    print("two-turn tool loop in a session:", await asyncio.to_thread(tool_loop, url, model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--free", type=int, default=50)
    ap.add_argument("--tools", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        proc, url = start_serve(data_dir)
        try:
            asyncio.run(main_async(args, url))
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
