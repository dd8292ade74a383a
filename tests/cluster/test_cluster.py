"""2 engine replicas behind the Ray Serve ingress, driven with the official SDKs.

- 8 sessions x 4 interleaved turns: every turn lands on its session's replica (hit rate 100 %,
  nothing moved), reuses its session's KV, and says what a no-cache run says;
- `ray.kill` of a replica once its turns are durable in the shared tier, while a round runs:
  every request after it succeeds (the SDK's retries allowed), the dead replica's sessions
  continue elsewhere restored from the shared tier (tokens reused > 0) with a no-cache run's
  outputs;
- the same routes, errors and streaming as `shoal serve`, OpenAI's and Anthropic's;
- a batch created through the ingress runs on both replicas (their shared PostgreSQL store);
  kill -9 of one while it holds answered lines (the line gate keeps them in flight, on any CPU)
  and it still completes with every result exactly once;
- two tenants (`--keys`) sending the same long prompt, in like-named sessions and without:
  the second is told of no cached tokens on any replica, the first's next turn is.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
import ray
from batch_helpers import TERMINAL, HeldLines, chat_line, jsonl, read_lines, upload
from cluster_harness import KEYS, PATIENCE_S, Cluster

from shoal import LLM, SamplingParams

SESSIONS = 8
TURNS = 4
MAX_TOKENS = 8
BATCH_LINES = 48
BATCH_TOKENS = 48


@dataclass
class Turn:
    text: str
    replica: str
    cached: int


@dataclass
class Conversation:
    session: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def ask(self, client: openai.OpenAI, model: str, t: int, max_tokens: int) -> None:
        self.messages.append({"role": "user", "content": f"{self.session}, turn {t}: go on."})
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"X-Session-Id": self.session},
        )
        reply = raw.parse()
        text = reply.choices[0].message.content or ""
        details = reply.usage.prompt_tokens_details if reply.usage else None
        cached = (details.cached_tokens or 0) if details else 0
        self.turns.append(Turn(text, raw.headers["x-shoal-replica"], cached))
        self.messages.append({"role": "assistant", "content": text})


def sdk(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=8, timeout=120)


def play_round(
    convs: list[Conversation], client: openai.OpenAI, model: str, t: int, max_tokens: int
) -> None:
    with ThreadPoolExecutor(len(convs)) as pool:
        for f in [pool.submit(c.ask, client, model, t, max_tokens) for c in convs]:
            f.result()  # a request that failed even after the SDK's retries fails the test


def metric(cluster: Cluster, name: str, **labels: str) -> dict[str, float]:
    """{replica: value} of one metric family sample from the ingress's /metrics."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=60).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
        if m is None:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            found[got["replica"]] = float(m.group(2))
    return found


def no_cache_outputs(cluster: Cluster, convs: list[Conversation], max_tokens: list[int]) -> None:
    """Each turn's output equals a run without any cache, given the same conversation."""
    llm = LLM(str(cluster.model_dir), enable_prefix_caching=False, num_blocks=512)
    for conv in convs:
        history: list[dict[str, Any]] = []
        for t, turn in enumerate(conv.turns):
            history.append(conv.messages[2 * t])
            params = SamplingParams(max_tokens=max_tokens[t], temperature=0.0)
            (out,) = llm.chat(history, params)
            assert turn.text == out.text, f"{conv.session} turn {t + 1}"
            history.append(conv.messages[2 * t + 1])


def test_every_turn_lands_on_its_sessions_replica(cluster: Cluster) -> None:
    client = sdk(cluster)
    convs = [Conversation(f"affine-{i}") for i in range(SESSIONS)]
    placements = "shoal_cluster_session_requests_total"
    moved_before = sum(metric(cluster, placements, placement="moved").values())
    hits_before = sum(metric(cluster, "shoal_session_hits_total").values())
    for t in range(TURNS):
        play_round(convs, client, cluster.model, t, MAX_TOKENS)
    for conv in convs:
        assert len({turn.replica for turn in conv.turns}) == 1, conv.session
        assert all(turn.cached > 0 for turn in conv.turns[1:]), conv.session
    assert len({conv.turns[0].replica for conv in convs}) == 2  # both replicas have sessions
    hit_rate = metric(cluster, "shoal_cluster_session_hit_rate")
    assert hit_rate and all(v == 1.0 for v in hit_rate.values())
    moved = sum(metric(cluster, placements, placement="moved").values())
    assert moved == moved_before
    hits = sum(metric(cluster, "shoal_session_hits_total").values())
    assert hits - hits_before == SESSIONS * (TURNS - 1)  # the engines reused session KV
    no_cache_outputs(cluster, convs, [MAX_TOKENS] * TURNS)


def test_a_killed_replicas_sessions_continue_restored_from_the_tier(cluster: Cluster) -> None:
    client = sdk(cluster)
    convs = [Conversation(f"failover-{i}") for i in range(SESSIONS)]
    tokens = [MAX_TOKENS, MAX_TOKENS, 48, MAX_TOKENS]  # turn 3 is long: the kill may land mid-turn
    for t in range(2):
        play_round(convs, client, cluster.model, t, tokens[t])
    homes = [conv.turns[-1].replica for conv in convs]
    victim = max(set(homes), key=homes.count)
    orphans = [c for c, home in zip(convs, homes, strict=True) if home == victim]
    reads_before = sum(metric(cluster, "shoal_tier_reads_total").values())
    # The tier's promise is for turns it holds durably: wait for every queued write to land.
    # What follows holds wherever the kill lands in round 3 (mid-turn: the SDK retries
    # elsewhere; after it: round 4 moves), so the killer only tries for mid-turn.
    deadline = time.monotonic() + PATIENCE_S
    while any(metric(cluster, "shoal_tier_pending").values()):
        assert time.monotonic() < deadline, "the session tier did not catch up"
        time.sleep(0.05)
    round_over = threading.Event()

    def kill_while_running() -> None:
        running = "shoal_num_requests_running"
        while not (round_over.is_set() or metric(cluster, running).get(victim, 0) > 0):
            time.sleep(0.01)
        ray.kill(cluster.replica_actor(victim), no_restart=True)

    killer = threading.Thread(target=kill_while_running)
    killer.start()
    try:
        play_round(convs, client, cluster.model, 2, tokens[2])
    finally:
        round_over.set()
        killer.join()
    play_round(convs, client, cluster.model, 3, tokens[3])

    for conv in orphans:
        after = [turn for turn in conv.turns[2:] if turn.replica != victim]
        assert after, f"{conv.session} never left the killed replica"
        assert after[0].cached > 0, f"{conv.session} recomputed its history"
    assert all(turn.replica != victim for conv in convs for turn in conv.turns[3:])
    reads = sum(metric(cluster, "shoal_tier_reads_total").values())
    assert reads > reads_before  # restored from the shared tier, not recomputed
    no_cache_outputs(cluster, convs, tokens)


def test_a_response_chain_stays_on_its_replica(cluster: Cluster) -> None:
    """A chain's first answer names it (X-Session-Id); its later turns, routed by the id they
    continue, land where its KV is and reuse it."""
    client = sdk(cluster)
    for i in range(SESSIONS):
        replicas, cached, previous = [], [], {}
        for t in range(3):
            raw = client.responses.with_raw_response.create(
                model=cluster.model,
                input=f"chain {i}, turn {t}: go on",
                temperature=0,
                max_output_tokens=MAX_TOKENS,
                **previous,
            )
            r = raw.parse()
            assert r.usage is not None
            replicas.append(raw.headers["x-shoal-replica"])
            cached.append(r.usage.input_tokens_details.cached_tokens)
            previous = {"previous_response_id": r.id}
        assert len(set(replicas)) == 1 and all(c > 0 for c in cached[1:]), (replicas, cached)


def test_same_routes_errors_and_streaming_as_shoal_serve(cluster: Cluster) -> None:
    client = sdk(cluster)
    chunks = client.chat.completions.create(
        model=cluster.model,
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=cluster.model,
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=6,
        temperature=0,
    )
    assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=4)
    message = claude.messages.create(
        model=cluster.model, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.type == "message" and message.usage.output_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=cluster.model, max_tokens=0, messages=[])
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    assert httpx.get(f"{cluster.url}/health", timeout=30).json()["status"] == "ok"


def wait_for_replicas(cluster: Cluster, n: int, timeout: float = PATIENCE_S) -> list[str]:
    """The live replicas, once there are `n` (Ray Serve replaces one an earlier test killed)."""
    deadline = time.monotonic() + timeout
    while len(live := metric(cluster, "shoal_num_sessions")) < n:
        assert time.monotonic() < deadline, f"only {len(live)} replicas came up"
        time.sleep(0.5)
    return sorted(live)


def test_a_batch_running_during_a_replica_kill_completes_exactly_once(cluster: Cluster) -> None:
    client = sdk(cluster)
    wait_for_replicas(cluster, 2)
    lines = [
        chat_line(f"line-{i}", cluster.model, f"batch line {i}", BATCH_TOKENS, ignore_eos=True)
        for i in range(BATCH_LINES)
    ]
    data = jsonl(lines)
    file_id = upload(client, data, "lines.jsonl")  # the Files API through the ingress
    assert client.files.retrieve(file_id).bytes == len(data)
    assert client.files.content(file_id).content == data
    assert file_id in {f.id for f in client.files.list()}
    gate = HeldLines(cluster.gate)
    gate.close()
    try:
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        # Both replicas run the batch created through one of them: each holds answered lines.
        gate.wait(lambda held: len(held) == 2)
        victim = min(gate.by_process())
        os.kill(victim, signal.SIGKILL)  # kill -9, with lines claimed and in flight
        status = client.batches.retrieve(batch.id).status
        assert status == "in_progress"  # the API answers, and no answer has been stored yet
    finally:
        gate.open()
    deadline = time.monotonic() + PATIENCE_S
    while (batch := client.batches.retrieve(batch.id)).status not in TERMINAL:
        assert time.monotonic() < deadline, f"the batch did not finish: {batch}"
        time.sleep(0.2)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (BATCH_LINES, 0)
    assert batch.error_file_id is None
    results = read_lines(client, batch.output_file_id)
    ids = Counter(r["custom_id"] for r in results)
    assert sorted(ids) == sorted(x["custom_id"] for x in lines) and set(ids.values()) == {1}
    tokens = {r["response"]["body"]["usage"]["completion_tokens"] for r in results}
    assert tokens == {BATCH_TOKENS}


def cached_turn(client: openai.OpenAI, model: str, text: str, session: str | None) -> int:
    headers = {"X-Session-Id": session} if session else {}
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers=headers,
    )
    details = reply.usage.prompt_tokens_details if reply.usage else None
    return (details.cached_tokens or 0) if details else 0


def test_tenants_never_reuse_each_others_kv_on_any_replica(cluster: Cluster) -> None:
    """The same long prompt, in like-named sessions and with none: the second tenant is told
    of no cached tokens wherever its turn lands (the salt holds in every replica's tiers and
    the shared one), the first tenant's next turn is."""
    alpha, beta = (
        openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=8, timeout=120)
        for key in KEYS
    )
    for topic, session in (("Whales", "tenant-0"), ("Storms", "tenant-1"), ("Tides", None)):
        text = f"{topic}: " + "tell me about the sea and the rain. " * 6
        assert cached_turn(alpha, cluster.model, text, session) == 0
        assert cached_turn(beta, cluster.model, text, session) == 0, session
        assert cached_turn(alpha, cluster.model, text, session) > 0, session
