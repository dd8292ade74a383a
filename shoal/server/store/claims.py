"""A running batch's lines, the replicas that claim them, and their results.

Every replica records a batch's lines once it runs (`add_lines`), claims as many as it has
room for (`claim_lines`) and writes each answer (`add_result`). A claim names its replica and
holds while the replica's heartbeat does (`replicas.expires_at`, on the database's clock);
then another replica re-takes the line. A result is keyed by `(batch_id, custom_id)` and
accepted only while its batch is `in_progress`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from shoal.server.store.sql import Tables, Tx, marks
from shoal.server.store.status import BatchStatus


class LineTables(Tables):
    def heartbeat(self, replica: str, lease_s: float) -> None:
        """`replica` is alive for `lease_s` more seconds: its claims hold until then."""
        with self._tx() as tx:
            tx.q(
                f"INSERT INTO replicas (id, expires_at) VALUES (?, {self.NOW} + ?) "
                "ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at",
                (replica, float(lease_s)),
            )

    def release_lines(self, replica: str, batch_id: str | None = None) -> None:
        """Hand back `replica`'s unfinished lines (of one batch, or all of them)."""
        sql, args = "UPDATE lines SET owner = NULL WHERE owner = ? AND done = 0", [replica]
        if batch_id is not None:
            sql += " AND batch_id = ?"
            args.append(batch_id)
        with self._tx() as tx:
            tx.q(sql, args)

    def leave(self, replica: str) -> None:
        """A clean exit: others may take its lines and finalizations at once."""
        self.release_lines(replica)
        with self._tx() as tx:
            tx.q("DELETE FROM replicas WHERE id = ?", (replica,))

    def add_lines(self, batch_id: str, keys: Sequence[tuple[str, int]]) -> None:
        """Record a running batch's lines `(custom_id, line number)` once (every replica
        calls this; lines that already have a result are marked done)."""
        with self._tx() as tx:
            have = tx.q("SELECT COUNT(*) FROM lines WHERE batch_id = ?", (batch_id,)).fetchone()
            if int(have[0]) >= len(keys):
                return
            self._insert_lines(tx, batch_id, keys)
            tx.q(
                "UPDATE lines SET done = 1 WHERE batch_id = ? AND done = 0 AND custom_id IN "
                "(SELECT custom_id FROM results WHERE batch_id = ?)",
                (batch_id, batch_id),
            )

    def _insert_lines(self, tx: Tx, batch_id: str, keys: Sequence[tuple[str, int]]) -> None:
        tx.many(
            "INSERT INTO lines (batch_id, custom_id, line) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            [(batch_id, cid, no) for cid, no in keys],
        )

    def claim_lines(self, batch_id: str, replica: str, limit: int) -> list[str]:
        """Up to `limit` unfinished lines nobody alive holds, now `replica`'s, in file order.

        The update re-checks each row against the rule: under concurrent claims PostgreSQL's
        search may return a row that another claimer took since it looked, and only the
        update sees the row's latest owner (the rule reads `replicas` in a subquery, not a
        join, for that re-check to hold)."""
        free = (
            "done = 0 AND (owner IS NULL OR (owner <> ? AND owner NOT IN "
            f"(SELECT id FROM replicas WHERE expires_at >= {self.NOW})))"
        )
        with self._tx() as tx:
            rows = tx.q(
                f"SELECT custom_id FROM lines WHERE batch_id = ? AND {free} "
                f"ORDER BY line LIMIT ?{self.CLAIM_LOCK}",
                (batch_id, replica, limit),
            ).fetchall()
            ids = [r[0] for r in rows]
            if not ids:
                return []
            won = tx.q(
                f"UPDATE lines SET owner = ? WHERE batch_id = ? AND {free} "
                f"AND custom_id IN ({marks(ids)}) RETURNING custom_id",
                (replica, batch_id, replica, *ids),
            ).fetchall()
        taken = {r[0] for r in won}
        return [i for i in ids if i in taken]

    def lines_left(self, batch_id: str) -> int:
        sql = "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND done = 0"
        return int(self._rows(sql, (batch_id,))[0][0])

    def _left(self, tx: Tx, batch_id: str) -> bool:
        sql = "SELECT 1 FROM lines WHERE batch_id = ? AND done = 0 LIMIT 1"
        return tx.q(sql, (batch_id,)).fetchone() is not None

    # -- results ---------------------------------------------------------------------------
    def add_result(
        self,
        batch_id: str,
        custom_id: str,
        line: int,
        ok: bool,
        body: dict[str, Any],
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> bool:
        """Record one finished request; False if it was already recorded or its batch is no
        longer in progress (cancelled, expired, finalizing: the result is not wanted)."""
        with self._tx() as tx:
            row = tx.q(
                f"SELECT status FROM batches WHERE id = ?{self.FOR_SHARE}", (batch_id,)
            ).fetchone()
            if row is None or row[0] != BatchStatus.IN_PROGRESS:
                return False
            cur = tx.q(
                "INSERT INTO results (batch_id, custom_id, line, ok, body, prompt_tokens, "
                "completion_tokens) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (batch_id, custom_id, line, int(ok), json.dumps(body), prompt_tokens,
                 completion_tokens),
            )  # fmt: skip
            tx.q(
                "UPDATE lines SET done = 1, owner = NULL WHERE batch_id = ? AND custom_id = ?",
                (batch_id, custom_id),
            )
            return bool(cur.rowcount > 0)

    def done_custom_ids(self, batch_id: str) -> set[str]:
        sql = "SELECT custom_id FROM results WHERE batch_id = ?"
        return {r[0] for r in self._rows(sql, (batch_id,))}

    def result_counts(self, batch_id: str) -> tuple[int, int, int, int]:
        """(completed, failed, prompt_tokens, completion_tokens)."""
        row = self._rows(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
            "FROM results WHERE batch_id = ?",
            (batch_id,),
        )[0]
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])

    def results(self, batch_id: str) -> Iterator[tuple[bool, str]]:
        sql = "SELECT ok, body FROM results WHERE batch_id = ? ORDER BY line"
        for r in self._rows(sql, (batch_id,)):
            yield bool(r[0]), r[1]
