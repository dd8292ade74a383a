"""Routing decisions without Ray: what key a request routes by, where rendezvous hashing sends
it as replicas come and go, when load overrides the home, and how placements are counted."""

from __future__ import annotations

import json

import pytest

from shoal.cluster.routing import (
    BATCH_KEY,
    Route,
    RoutingStats,
    SessionHomes,
    rank,
    rendezvous,
    route_for,
)


def chat(**body: object) -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    return json.dumps({"model": "m", "messages": messages, **body}).encode()


def test_a_request_routes_by_its_session_then_its_prompt() -> None:
    header = route_for("POST", "/v1/chat/completions", {"x-session-id": "h"}, chat(session_id="b"))
    assert header == Route(session_id="h")  # the header wins, as in `shoal serve`
    assert route_for("POST", "/v1/chat/completions", {}, chat(session_id="b")).session_id == "b"
    system = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "x"}]
    by_prompt = route_for("POST", "/v1/chat/completions", {}, chat(messages=system))
    assert by_prompt.session_id is None and by_prompt.affinity == "You are terse.\nx"
    messages = json.dumps({"system": [{"type": "text", "text": "S"}], "messages": []}).encode()
    assert route_for("POST", "/v1/messages", {}, messages).affinity == "S"
    tokens = json.dumps({"prompt": [1, 2, 3]}).encode()
    assert route_for("POST", "/v1/completions", {}, tokens).affinity == "1 2 3"
    for path in ("/v1/files", "/v1/batches/batch_1", "/v1/messages/batches"):
        assert route_for("GET", path, {}, b"") == Route(affinity=BATCH_KEY)  # a replica's store
        assert route_for("GET", path, {}, b"", shared_store=True) == Route()  # any replica
    assert route_for("GET", "/health", {}, b"") == Route()
    assert route_for("POST", "/v1/chat/completions", {}, b"{not json") == Route()


def test_a_response_chain_routes_by_its_first_response_id() -> None:
    """Every id in a chain starts with the chain's first id, the chain's session: its GETs,
    cancels and continuations all go to the replica holding its KV."""
    chain = "resp_" + "a" * 24
    later = chain + "b" * 24
    body = json.dumps({"input": "hi", "previous_response_id": later}).encode()
    assert route_for("POST", "/v1/responses", {}, body) == Route(session_id=chain)
    for method, path in (
        ("GET", f"/v1/responses/{later}"),
        ("DELETE", f"/v1/responses/{chain}"),
        ("POST", f"/v1/responses/{later}/cancel"),
        ("GET", f"/v1/responses/{later}/input_items"),
    ):
        assert route_for(method, path, {}, b"") == Route(session_id=chain)
    keyed = json.dumps({"input": "hi", "prompt_cache_key": "thread-7"}).encode()
    assert route_for("POST", "/v1/responses", {}, keyed) == Route(affinity="thread-7")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    first = json.dumps({"instructions": "Be terse.", "input": items}).encode()
    assert route_for("POST", "/v1/responses", {}, first) == Route(affinity="Be terse.\nx")
    counted = json.dumps({"input": "y", "previous_response_id": chain}).encode()
    assert route_for("POST", "/v1/responses/input_tokens", {}, counted) == Route(session_id=chain)
    assert route_for("GET", "/v1/responses/resp_short", {}, b"") == Route()


def test_a_tenants_route_is_in_its_namespace() -> None:
    """With `--keys`, tenants' like-named sessions and like prompts route apart, named as the
    replicas name them; the batch API's one home stays one."""
    sid = route_for("POST", "/v1/chat/completions", {"x-session-id": "s"}, chat(), tenant="acme")
    assert sid == Route(session_id="acme/s")
    prompt = route_for("POST", "/v1/chat/completions", {}, chat(), tenant="acme")
    assert prompt == Route(affinity="acme/hi")
    batch = route_for("GET", "/v1/files", {}, b"", tenant="acme")
    assert batch == Route(affinity=BATCH_KEY)
    assert route_for("GET", "/health", {}, b"", tenant="acme") == Route()


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves() -> None:
    replicas = ["a", "b", "c"]
    keys = [f"session-{i}" for i in range(300)]
    home = {k: rendezvous(k, replicas)[0] for k in keys}
    assert set(home.values()) == set(replicas)  # spread over all of them
    after = {k: rendezvous(k, ["a", "c"])[0] for k in keys}
    moved = {k for k in keys if home[k] != after[k]}
    assert moved == {k for k in keys if home[k] == "b"}
    for k in moved:  # each goes to its second choice
        assert after[k] == rendezvous(k, replicas)[1]
    joined = {k: rendezvous(k, [*replicas, "d"])[0] for k in keys}
    assert all(joined[k] in (home[k], "d") for k in keys)


@pytest.mark.parametrize(
    ("loads", "first"),
    [({}, "home"), ({"home": 8, "x": 0}, "home"), ({"home": 9, "x": 0, "y": 3}, "x")],
)
def test_the_home_takes_its_keys_until_it_is_overloaded(loads: dict[str, int], first: str) -> None:
    replicas = ["home", "x", "y"]
    key = next(f"k{i}" for i in range(1000) if rendezvous(f"k{i}", replicas)[0] == "home")
    ranks = rank(Route(session_id=key), replicas, loads, imbalance_threshold=8)
    assert ranks[0][0] == first
    assert sorted(r for group in ranks for r in group) == sorted(replicas)
    if first != "home":
        assert ranks[-1] == ["home"]  # still a last resort


def test_sessions_that_start_together_spread_evenly_and_stay_home() -> None:
    plain = [rendezvous(f"s{i}", ["a", "b"])[0] for i in range(16)]
    assert plain.count("a") == 3  # hashing alone puts 13 of these 16 on one replica
    for replicas in (["a", "b"], ["a", "b", "c"]):
        homes = SessionHomes()
        placed = {f"s{i}": homes.home(f"s{i}", replicas) for i in range(16)}
        per = [list(placed.values()).count(r) for r in replicas]
        assert max(per) - min(per) <= 1, per
        assert all(homes.home(s, replicas) == r for s, r in placed.items())  # they stay
    home = homes.home("s0", ["a", "b", "c"])
    assert rank(Route(session_id="s0"), ["a", "b", "c"], {}, 8, home)[0] == [home]


def test_a_session_follows_its_kv_and_leaves_a_dead_replica() -> None:
    homes = SessionHomes()
    first = homes.home("s", ["a", "b"])
    other = "b" if first == "a" else "a"
    homes.settle("s", other)  # its home was overloaded: the turn ran on the other replica
    assert homes.home("s", ["a", "b"]) == other  # the next turn follows the KV
    assert homes.home("s", [first, "c"]) in (first, "c")  # its replica died: placed again
    assert rendezvous("v", ["a", "b"])[0] == "b"
    small = SessionHomes(max_sessions=1)
    small.settle("x", "a")
    small.settle("y", "b")  # "x" is forgotten: b holds the one session known
    assert small.home("v", ["a", "b"]) == "a"


def test_pinned_and_keyless_requests() -> None:
    assert rank(Route(replica="b"), ["a", "b"], {}, 8) == [["b"]]
    assert rank(Route(replica="gone"), ["a", "b"], {}, 8) == []
    assert rank(Route(), ["a", "b"], {"a": 5}, 8) == [["a", "b"]]  # Ray picks the lighter
    assert rank(Route(session_id="s"), [], {}, 8) == []


def test_placements_are_counted_per_replica() -> None:
    stats = RoutingStats(max_sessions=2)
    for replica in ("a", "a", "a", "b"):  # new, hit, hit, moved
        stats.routed(Route(session_id="s"), replica)
    stats.routed(Route(affinity="prefix"), "a")  # not a session: not counted
    counts = stats.snapshot()
    assert (counts["a"].new, counts["a"].hits, counts["b"].moved) == (1, 2, 1)
    assert counts["a"].hit_rate == 1.0 and counts["b"].hit_rate == 0.0
    stats.routed(Route(session_id="t"), "a")
    stats.routed(Route(session_id="u"), "a")  # "s" is forgotten past max_sessions
    stats.routed(Route(session_id="s"), "a")
    assert stats.snapshot()["a"].new == 4
