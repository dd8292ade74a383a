"""Stored Responses API objects, in the same store as files and batches (SQLite or PostgreSQL).

A row is one response: the API object (`obj`), the input items it was answered from (the
whole context, the chain's earlier items included, as `GET .../input_items` lists them), its
chain (the engine session that holds the chain's KV) and, once it has finished, its `turn`:
the prompt text and token ids (prompt then output) that the chain's next response continues
from. Background responses also keep their stream's events, for `GET ...?stream=true`.

Rows are bounded: each insert drops rows past `max_age_s` and the oldest past `keep`. A
response belongs to its `tenant`: the API reads name it, so another tenant's is not found.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shoal.server.ids import storable
from shoal.server.store.sql import DEFAULT_TENANT, Tables, marks, owned

UNFINISHED = ("queued", "in_progress")


@dataclass(slots=True)
class StoredResponse:
    id: str
    chain: str  # the session id of the chain this response belongs to
    status: str
    obj: dict[str, Any]
    items: list[dict[str, Any]] = field(default_factory=list)
    turn: dict[str, Any] | None = None  # prompt_text, token_ids, num_prompt_tokens
    events: list[dict[str, Any]] | None = None
    owner: str | None = None  # the replica running an unfinished background response
    tenant: str = DEFAULT_TENANT  # whose response it is


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


_COLS = "id, chain, status, obj, items, turn, events, owner, tenant"


class ResponseTables(Tables):
    def add_response(self, r: StoredResponse, *, keep: int, max_age_s: float) -> None:
        """Store a new response and drop what the retention bounds no longer allow."""
        with self._tx() as tx:
            tx.q(
                f"INSERT INTO responses ({_COLS}, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    r.id, r.chain, r.status, _dump(r.obj), _dump(r.items), _dump(r.turn),
                    _dump(r.events), r.owner, r.tenant, int(r.obj.get("created_at") or time.time()),
                ),
            )  # fmt: skip
            tx.q("DELETE FROM responses WHERE created_at < ?", (int(time.time() - max_age_s),))
            tx.q(
                "DELETE FROM responses WHERE seq <= "
                "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (keep,),
            )

    def start_response(self, response_id: str, obj: dict[str, Any]) -> bool:
        """A queued background response is running now (False: it was cancelled first)."""
        with self._tx() as tx:
            cur = tx.q(
                "UPDATE responses SET status = ?, obj = ? WHERE id = ? AND status = 'queued'",
                (obj["status"], _dump(obj), response_id),
            )
            return bool(cur.rowcount > 0)

    def finish_response(
        self,
        response_id: str,
        obj: dict[str, Any],
        *,
        turn: dict[str, Any] | None = None,
        events: list[dict[str, Any]] | None = None,
        expect: Iterable[str] = UNFINISHED,
    ) -> bool:
        """Give an unfinished response its final object (and turn, events); False when it
        was no longer in one of `expect` (cancelled meanwhile, or gone)."""
        wanted = tuple(expect)
        with self._tx() as tx:
            cur = tx.q(
                "UPDATE responses SET status = ?, obj = ?, turn = ?, events = ?, owner = NULL "
                f"WHERE id = ? AND status IN ({marks(wanted)})",
                (obj["status"], _dump(obj), _dump(turn), _dump(events), response_id, *wanted),
            )
            return bool(cur.rowcount > 0)

    def get_response(self, response_id: str, *, tenant: str | None) -> StoredResponse | None:
        if not storable(response_id):
            return None
        cond, arg = owned(tenant)
        sql = f"SELECT {_COLS} FROM responses WHERE id = ?{cond}"
        rows = self._rows(sql, (response_id, *arg))
        if not rows:
            return None
        r = rows[0]
        return StoredResponse(
            r[0], r[1], r[2], _load(r[3]), _load(r[4]) or [], _load(r[5]), _load(r[6]), r[7], r[8]
        )

    def delete_response(self, response_id: str, *, tenant: str | None) -> str | None:
        """Forget a response; its chain's id when there was one, else None."""
        if not storable(response_id):
            return None
        cond, arg = owned(tenant)
        with self._tx() as tx:
            sql = f"SELECT chain FROM responses WHERE id = ?{cond}"
            row = tx.q(sql, (response_id, *arg)).fetchone()
            tx.q(f"DELETE FROM responses WHERE id = ?{cond}", (response_id, *arg))
        return None if row is None else str(row[0])

    def chain_has_responses(self, chain: str) -> bool:
        return bool(self._rows("SELECT 1 FROM responses WHERE chain = ? LIMIT 1", (chain,)))

    def unfinished_responses(self, owner: str) -> list[StoredResponse]:
        """Background responses `owner` was running when it stopped."""
        sql = f"SELECT id FROM responses WHERE owner = ? AND status IN ({marks(UNFINISHED)})"
        rows = self._rows(sql, (owner, *UNFINISHED))
        found = (self.get_response(r[0], tenant=None) for r in rows)
        return [r for r in found if r is not None]
