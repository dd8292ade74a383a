"""Stored responses, the same on SQLite and PostgreSQL: a response and its turn come back
whole, a finish is a compare-and-set on an unfinished response, deleting tells whether its
chain has any left, unfinished background responses are found by their replica, and the
retention bounds (count and age) drop the oldest rows; a replica that starts again fails the
background responses it was running."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shoal.server.responses.service import Responses
from shoal.server.store import Store
from shoal.server.store.responses import StoredResponse

BIG = 1_000_000


def response(
    rid: str, chain: str, status: str = "completed", created_at: float | None = None, **kw: Any
) -> StoredResponse:
    obj = {"id": rid, "status": status, "created_at": int(created_at or time.time())}
    return StoredResponse(rid, chain, status, obj, **kw)


def test_a_response_comes_back_whole(store: Store) -> None:
    turn = {
        "prompt_text": "<|im_start|>user\nhi",
        "token_ids": list(range(5000)),
        "num_prompt_tokens": 7,
    }
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": []}]
    store.add_response(
        response("resp_a", "resp_a", items=items, turn=turn), keep=BIG, max_age_s=1e9
    )
    got = store.get_response("resp_a", tenant=None)
    assert got is not None and got.turn == turn and got.items == items and got.chain == "resp_a"
    assert (
        store.get_response("resp_nope", tenant=None) is None
        and store.get_response("\x00", tenant=None) is None
    )


def test_finishing_is_a_compare_and_set(store: Store) -> None:
    store.add_response(response("resp_b", "resp_b", "queued", owner="r1"), keep=BIG, max_age_s=1e9)
    assert [r.id for r in store.unfinished_responses("r1")] == ["resp_b"]
    assert store.unfinished_responses("r2") == []
    cancelled = {"id": "resp_b", "status": "cancelled"}
    assert store.finish_response("resp_b", cancelled)
    done = {"id": "resp_b", "status": "completed"}
    assert not store.finish_response("resp_b", done, events=[{"type": "x"}])  # too late
    got = store.get_response("resp_b", tenant=None)
    assert got is not None and got.status == "cancelled" and got.owner is None
    assert store.unfinished_responses("r1") == []


def test_deleting_tells_whether_the_chain_goes_on(store: Store) -> None:
    for rid in ("resp_c", "resp_c1"):
        store.add_response(response(rid, "resp_c"), keep=BIG, max_age_s=1e9)
    assert store.delete_response("resp_c", tenant=None) == "resp_c"
    assert store.chain_has_responses("resp_c")
    assert store.delete_response("resp_c1", tenant=None) == "resp_c"
    assert (
        not store.chain_has_responses("resp_c")
        and store.delete_response("resp_c1", tenant=None) is None
    )


def test_retention_drops_the_oldest(store: Store) -> None:
    old = response("resp_old", "resp_old", created_at=time.time() - 3600)
    store.add_response(old, keep=BIG, max_age_s=1e9)
    for i in range(4):
        store.add_response(response(f"resp_{i}", f"resp_{i}"), keep=3, max_age_s=60)
    kept = [
        r
        for r in ("resp_old", "resp_0", "resp_1", "resp_2", "resp_3")
        if store.get_response(r, tenant=None)
    ]
    assert kept == ["resp_1", "resp_2", "resp_3"]


def test_a_restarted_replica_fails_what_it_was_running(store: Store) -> None:
    store.add_response(response("resp_d", "resp_d", "in_progress", owner="r1"), keep=BIG,
                       max_age_s=1e9)  # fmt: skip
    store.add_response(response("resp_e", "resp_e", "queued", owner="r2"), keep=BIG, max_age_s=1e9)
    asyncio.run(Responses(None, store, "r1", BIG, 1e9).start())  # type: ignore[arg-type]
    mine, theirs = (
        store.get_response("resp_d", tenant=None),
        store.get_response("resp_e", tenant=None),
    )
    assert mine is not None and mine.status == "failed" and mine.obj["error"]["message"]
    assert theirs is not None and theirs.status == "queued"  # another replica's to finish
