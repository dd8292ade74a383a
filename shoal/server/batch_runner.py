"""Runs batches in the background: validate, execute each line at batch priority, finalize.

The batch lifecycle lives here: `BatchStatus` and its transitions, and `execute_line`, which
answers one line through the same `prepare_*` and `respond` as the HTTP routes (so a batch
line and an interactive request with the same body are validated and answered the same way;
only the priority differs). One task per active batch; a shared semaphore bounds how many
batch requests are in the engine at once. Each finished request is written to the store
before anything else happens, so a restart resumes with only the missing `custom_id`s
(nothing lost, nothing twice). Cancelling or expiring aborts what is in flight; shutdown
stops launching, lets in-flight requests finish for a grace period, then aborts the rest
(they rerun on resume).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shoal.server.anthropic import messages as anthropic_messages
from shoal.server.errors import error_body, to_api_error
from shoal.server.formatting import batch_usage
from shoal.server.ids import new_id
from shoal.server.jsonl import MESSAGES, BatchLine, parse_batch_file, read_chunks
from shoal.server.protocol import ChatCompletionRequest, CompletionRequest
from shoal.server.serving import Serving, prepare_chat, prepare_completion, respond
from shoal.server.store import Store

log = logging.getLogger("shoal.server.batch")


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ACTIVE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
TERMINAL = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED)


@dataclass(slots=True)
class LineResult:
    status: int
    body: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def execute_line(
    serving: Serving, endpoint: str, body: dict[str, Any], priority: int
) -> LineResult:
    """One batch request, answered as the HTTP route would answer it."""
    if endpoint == MESSAGES:
        return LineResult(*await anthropic_messages.run_line(serving, body, priority))
    try:
        if endpoint == "/v1/chat/completions":
            req: Any = ChatCompletionRequest.model_validate(body)
            prep = await prepare_chat(serving, req, priority=priority)
        else:
            req = CompletionRequest.model_validate(body)
            prep = await prepare_completion(serving, req, priority=priority)
        result = await respond(serving, prep)
    except ValidationError as e:
        errs = e.errors()
        param = ".".join(str(p) for p in errs[0]["loc"]) if errs else None
        msg = errs[0]["msg"] if errs else str(e)
        return LineResult(400, error_body(400, f"invalid request: {msg}", param=param or None))
    except Exception as e:
        err = to_api_error(e)
        return LineResult(err.status, err.body())
    usage = result["usage"]
    return LineResult(200, result, usage["prompt_tokens"], usage["completion_tokens"])


_NOT_RUN = {
    BatchStatus.EXPIRED: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    BatchStatus.CANCELLED: (
        "batch_cancelled",
        "This request was not executed because the batch was cancelled.",
    ),
}


class BatchRunner:
    def __init__(
        self,
        store: Store,
        serving: Serving,
        *,
        concurrency: int,
        max_lines: int,
        priority: int,
        poll_s: float = 0.2,
    ) -> None:
        self.store = store
        self.serving = serving
        self.max_lines = max_lines
        self.priority = priority
        self.poll_s = poll_s
        self._sem = asyncio.Semaphore(concurrency)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self._stopping = False

    # -- control ---------------------------------------------------------------------------
    def start(self) -> None:
        for batch_id in self.store.batch_ids(ACTIVE):
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
            with self.store.file_path(obj["input_file_id"]).open("rb") as f:
                return parse_batch_file(
                    read_chunks(f), max_lines=self.max_lines, endpoint=obj["endpoint"]
                )
        except FileNotFoundError:
            return [], [
                {
                    "code": "file_not_found",
                    "message": "the input file is gone",
                    "param": "input_file_id",
                    "line": None,
                }
            ]

    async def _run(self, batch_id: str) -> None:
        obj = self.store.get_batch(batch_id)
        if obj is None:
            return
        lines, errors = self._lines(obj)
        status = BatchStatus(obj["status"])
        if status is BatchStatus.VALIDATING:
            if errors:
                self.store.update_batch(
                    batch_id,
                    status=BatchStatus.FAILED,
                    failed_at=int(time.time()),
                    errors={"object": "list", "data": errors[:100]},
                )
                return
            model = next((ln.body.get("model") for ln in lines), None)
            status = BatchStatus.IN_PROGRESS
            self.store.update_batch(
                batch_id,
                status=status,
                in_progress_at=int(time.time()),
                model=model if isinstance(model, str) else None,
                request_counts={"total": len(lines), "completed": 0, "failed": 0},
            )
        if status is BatchStatus.IN_PROGRESS:
            final = await self._execute_all(batch_id, obj.get("expires_at"), lines)
            if final is None:
                return  # stopping: resume later
            if final is BatchStatus.COMPLETED:
                self.store.update_batch(
                    batch_id, status=BatchStatus.FINALIZING, finalizing_at=int(time.time())
                )
            self._finalize(batch_id, lines, final)
        elif status is BatchStatus.FINALIZING:
            self._finalize(batch_id, lines, BatchStatus.COMPLETED)
        elif status is BatchStatus.CANCELLING:
            self._finalize(batch_id, lines, BatchStatus.CANCELLED)

    def _interrupted(self, batch_id: str, expires_at: int | None) -> BatchStatus | None:
        if self._cancel[batch_id].is_set():
            return BatchStatus.CANCELLED
        if expires_at is not None and time.time() >= expires_at:
            return BatchStatus.EXPIRED
        return None

    async def _execute_all(
        self, batch_id: str, expires_at: int | None, lines: list[BatchLine]
    ) -> BatchStatus | None:
        """Run every line not yet done; the final status, or None when stopping."""
        done = self.store.done_custom_ids(batch_id)
        pending = [ln for ln in lines if ln.custom_id not in done]
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
        return BatchStatus.COMPLETED

    async def _one(self, batch_id: str, ln: BatchLine) -> None:
        while True:
            r = await execute_line(self.serving, ln.url, ln.body, self.priority)
            if r.status == 429:  # the engine queue is full: wait, do not fail the request
                await asyncio.sleep(0.5)
                continue
            if r.status == 503:  # shutting down: leave it for the resume
                return
            break
        rid = r.body.get("id") if r.status == 200 else None
        line = {
            "id": new_id("batch_req_"),
            "custom_id": ln.custom_id,
            "response": {
                "status_code": r.status,
                "request_id": rid or new_id("req_"),
                "body": r.body,
            },
            "error": None,
        }
        ok = r.status == 200
        if self.store.add_result(
            batch_id, ln.custom_id, ln.line, ok, line, r.prompt_tokens, r.completion_tokens
        ):
            outcome = "completed" if ok else "failed"
            self.serving.metrics.batch_requests.labels(outcome=outcome).inc()

    def _finalize(self, batch_id: str, lines: list[BatchLine], status: BatchStatus) -> None:
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
        fields["usage"] = batch_usage(pt, ct)
        fields[f"{status}_at"] = now
        self.store.update_batch(batch_id, status=status, **fields)
