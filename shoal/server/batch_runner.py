"""Runs batches in the background: validate, execute each line at batch priority, finalize.

One task per active batch; a shared semaphore bounds how many batch requests are in the
engine at once. Each finished request is written to the store before anything else happens,
so a restart resumes with only the missing `custom_id`s (nothing lost, nothing twice).
Cancelling or expiring aborts what is in flight; shutdown stops launching, lets in-flight
requests finish for a grace period, then aborts the rest (they rerun on resume).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.server.jsonl import BatchLine, parse_batch_file
from shoal.server.store import Store, new_id

log = logging.getLogger("shoal.server.batch")

# (endpoint, body) -> (status_code, response body, prompt_tokens, completion_tokens)
Execute = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any], int, int]]]

_NOT_RUN = {
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    "cancelled": (
        "batch_cancelled",
        "This request was not executed because the batch was cancelled.",
    ),
}


class BatchRunner:
    def __init__(
        self,
        store: Store,
        execute: Execute,
        *,
        concurrency: int,
        max_lines: int,
        poll_s: float = 0.2,
    ) -> None:
        self.store = store
        self.execute = execute
        self.max_lines = max_lines
        self.poll_s = poll_s
        self._sem = asyncio.Semaphore(concurrency)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self._stopping = False

    # -- control ---------------------------------------------------------------------------
    def start(self) -> None:
        for batch_id in self.store.active_batch_ids():
            self.submit(batch_id)

    def submit(self, batch_id: str) -> None:
        if self._stopping or batch_id in self._tasks:
            return
        self._cancel.setdefault(batch_id, asyncio.Event())
        task = asyncio.create_task(self._run(batch_id), name=f"batch-{batch_id}")
        self._tasks[batch_id] = task

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.pop(batch_id, None)
            self._cancel.pop(batch_id, None)
            if not t.cancelled() and t.exception() is not None:
                log.error("batch %s failed", batch_id, exc_info=t.exception())

        task.add_done_callback(done)

    def cancel(self, batch_id: str) -> None:
        """The batch is already marked `cancelling` in the store; stop its work."""
        event = self._cancel.get(batch_id)
        if event is not None:
            event.set()
        else:
            self.submit(batch_id)

    async def stop(self, grace_s: float) -> None:
        """Stop launching requests; give in-flight ones `grace_s`, then abort them."""
        self._stopping = True
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- one batch -------------------------------------------------------------------------
    def _lines(self, obj: dict[str, Any]) -> tuple[list[BatchLine], list[dict[str, Any]]]:
        try:
            data = self.store.read_file(obj["input_file_id"])
        except FileNotFoundError:
            return [], [
                {
                    "code": "file_not_found",
                    "message": "the input file is gone",
                    "param": "input_file_id",
                    "line": None,
                }
            ]
        return parse_batch_file(data, max_lines=self.max_lines, endpoint=obj["endpoint"])

    async def _run(self, batch_id: str) -> None:
        obj = self.store.get_batch(batch_id)
        if obj is None:
            return
        lines, errors = self._lines(obj)
        if obj["status"] == "validating":
            if errors:
                self.store.update_batch(
                    batch_id,
                    status="failed",
                    failed_at=int(time.time()),
                    errors={"object": "list", "data": errors[:100]},
                )
                return
            model = next((ln.body.get("model") for ln in lines), None)
            obj = self.store.update_batch(
                batch_id,
                status="in_progress",
                in_progress_at=int(time.time()),
                model=model if isinstance(model, str) else None,
                request_counts={"total": len(lines), "completed": 0, "failed": 0},
            )
        if obj["status"] == "in_progress":
            final = await self._execute_all(batch_id, obj, lines)
            if final is None:
                return  # stopping: resume later
            if final == "completed":
                self.store.update_batch(
                    batch_id, status="finalizing", finalizing_at=int(time.time())
                )
                self._finalize(batch_id, lines, "completed")
            elif final == "cancelled":
                self._finalize(batch_id, lines, "cancelled")
            else:
                self._finalize(batch_id, lines, "expired")
        elif obj["status"] == "finalizing":
            self._finalize(batch_id, lines, "completed")
        elif obj["status"] == "cancelling":
            self._finalize(batch_id, lines, "cancelled")

    def _interrupted(self, batch_id: str, expires_at: int | None) -> str | None:
        if self._cancel[batch_id].is_set():
            return "cancelled"
        if expires_at is not None and time.time() >= expires_at:
            return "expired"
        return None

    async def _execute_all(
        self, batch_id: str, obj: dict[str, Any], lines: list[BatchLine]
    ) -> str | None:
        """Run every line not yet done; the final status, or None when stopping."""
        done = self.store.done_custom_ids(batch_id)
        pending = [ln for ln in lines if ln.custom_id not in done]
        expires_at = obj.get("expires_at")
        inflight: set[asyncio.Task[None]] = set()
        try:
            for ln in pending:
                while self._sem.locked():  # wait for a slot, watching for interruptions
                    if self._stopping or self._interrupted(batch_id, expires_at):
                        break
                    if inflight:
                        await asyncio.wait(
                            inflight, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED
                        )
                    else:  # other batches hold every slot
                        await asyncio.sleep(self.poll_s)
                if self._stopping or self._interrupted(batch_id, expires_at):
                    break
                await self._sem.acquire()
                task = asyncio.create_task(self._one(batch_id, ln))
                task.add_done_callback(lambda _t: self._sem.release())
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            while inflight:
                if self._interrupted(batch_id, expires_at):
                    break
                await asyncio.wait(inflight, timeout=self.poll_s)
        finally:
            for t in list(inflight):
                t.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
        reason = self._interrupted(batch_id, expires_at)
        if reason is not None:
            return reason
        if self._stopping and len(self.store.done_custom_ids(batch_id)) < len(lines):
            return None
        return "completed"

    async def _one(self, batch_id: str, ln: BatchLine) -> None:
        while True:
            status, body, pt, ct = await self.execute(ln.url, ln.body)
            if status == 429:  # the engine queue is full: wait, do not fail the request
                await asyncio.sleep(0.5)
                continue
            if status == 503:  # shutting down: leave it for the resume
                return
            break
        rid = body.get("id") if status == 200 else None
        line = {
            "id": new_id("batch_req_"),
            "custom_id": ln.custom_id,
            "response": {"status_code": status, "request_id": rid or new_id("req_"), "body": body},
            "error": None,
        }
        self.store.add_result(batch_id, ln.custom_id, ln.line, status == 200, line, pt, ct)

    def _finalize(self, batch_id: str, lines: list[BatchLine], status: str) -> None:
        out: list[str] = []
        err: list[str] = []
        for ok, body in self.store.results(batch_id):
            (out if ok else err).append(body)
        if status in _NOT_RUN:
            code, message = _NOT_RUN[status]
            done = self.store.done_custom_ids(batch_id)
            for ln in lines:
                if ln.custom_id not in done:
                    err.append(
                        json.dumps(
                            {
                                "id": new_id("batch_req_"),
                                "custom_id": ln.custom_id,
                                "response": None,
                                "error": {"code": code, "message": message},
                            }
                        )
                    )
        fields: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
        for key, rows, suffix in (
            ("output_file_id", out, "output"),
            ("error_file_id", err, "errors"),
        ):
            if rows:
                fid = f"file-{batch_id.removeprefix('batch_')}{suffix[0]}"
                self.store.create_file(
                    f"{batch_id}_{suffix}.jsonl",
                    "batch_output",
                    ("\n".join(rows) + "\n").encode(),
                    file_id=fid,
                )
                fields[key] = fid
        completed, failed, pt, ct = self.store.result_counts(batch_id)
        now = int(time.time())
        fields["request_counts"] = {"total": len(lines), "completed": completed, "failed": failed}
        fields["usage"] = usage_obj(pt, ct)
        fields[f"{status}_at"] = now
        self.store.update_batch(batch_id, status=status, **fields)


def usage_obj(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }
