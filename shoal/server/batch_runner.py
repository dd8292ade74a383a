"""Runs batches in the background, together with every server that shares the store.

`execute_line` answers one line through the same `prepare_*` and `respond` as the HTTP
routes (so a batch line and an interactive request with the same body are validated and
answered the same way; only the priority differs), as the batch's tenant. The runner keeps
one task per active batch on this server, and a watcher picks up batches that other servers
created. Each replica claims lines as it has room (`concurrency` batch requests in its
engine at once), so a batch fans out over every replica; each finished request is written to
the store before anything else happens, keyed by `(batch_id, custom_id)`, so nothing is lost
and nothing is written twice. A replica that dies stops its heartbeat; its claims lapse
after `lease_s` and the others re-take its lines. Every status change is a compare-and-set
in the store, and one replica at a time finalizes, so validation, cancellation, expiry and
the output files happen once, whichever replica gets there. Cancelling or expiring aborts
what is in flight; shutdown stops launching, lets in-flight requests finish for a grace
period, aborts the rest and hands their lines back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from shoal.server.anthropic import messages as anthropic_messages
from shoal.server.batch_output import output_files, result_line
from shoal.server.errors import APIError, error_body, to_api_error
from shoal.server.formatting import batch_usage
from shoal.server.jsonl import MESSAGES, RESPONSES, BatchLine, parse_batch_file
from shoal.server.line_gate import LineGate
from shoal.server.protocol import ChatCompletionRequest, CompletionRequest
from shoal.server.replica import Heartbeat
from shoal.server.serving import Serving, prepare_chat, prepare_completion, respond
from shoal.server.store import (
    ACTIVE,
    CLOSING,
    TERMINAL,
    BatchStatus,
    Store,
    StoreError,
)
from shoal.server.tenancy import Tenancy, Tenant

if TYPE_CHECKING:
    from shoal.server.responses.service import Responses

__all__ = ["ACTIVE", "TERMINAL", "BatchRunner", "BatchStatus", "LineResult", "execute_line"]

log = logging.getLogger("shoal.server.batch")
T = TypeVar("T")


@dataclass(slots=True)
class LineResult:
    status: int
    body: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def execute_line(
    serving: Serving,
    endpoint: str,
    body: dict[str, Any],
    priority: int,
    tenant: Tenant,
    responses: Responses | None = None,
) -> LineResult:
    """One batch request of `tenant`'s, answered as the HTTP route would answer it
    (`/v1/responses` lines through `responses`: they read and store responses)."""
    if endpoint == MESSAGES:
        return LineResult(*await anthropic_messages.run_line(serving, body, priority, tenant))
    try:
        if endpoint == RESPONSES:
            if responses is None:
                raise APIError(400, "this server does not run /v1/responses lines")
            answer = await responses.run_line(body, priority, tenant)
            used = answer["usage"]
            return LineResult(200, answer, used["input_tokens"], used["output_tokens"])
        if endpoint == "/v1/chat/completions":
            req: Any = ChatCompletionRequest.model_validate(body)
            prep = await prepare_chat(serving, req, tenant=tenant, priority=priority)
        else:
            req = CompletionRequest.model_validate(body)
            prep = await prepare_completion(serving, req, tenant=tenant, priority=priority)
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


class BatchRunner:
    def __init__(
        self,
        store: Store,
        serving: Serving,
        *,
        concurrency: int,
        max_lines: int,
        priority: int,
        replica: str,
        lease_s: float = 10.0,
        poll_s: float = 0.2,
        watch_s: float = 1.0,
        responses: Responses | None = None,
        gate: LineGate | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        """`poll_s`: how often a batch waiting for room looks again; `watch_s`: how often
        the store is asked for new batches and for status changes made elsewhere; `gate`: a
        test hook that holds answered lines before their results are stored."""
        self.store = store
        self.serving = serving
        self.responses = responses
        self.max_lines = max_lines
        self.priority = priority
        self.replica = replica
        self.poll_s = poll_s
        self.watch_s = watch_s
        self._capacity = concurrency
        self._busy = 0  # this server's batch requests in flight, all batches together
        self._heartbeat = Heartbeat(store, replica, lease_s)
        self._gate = gate
        self.tenancy = tenancy or Tenancy()
        self._owners: dict[str, Tenant] = {}  # whose lines each running batch's are
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False

    async def _call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """A store call, off the event loop (PostgreSQL is a network round trip away)."""
        return await asyncio.to_thread(fn, *args, **kw)

    # -- control ---------------------------------------------------------------------------
    def start(self) -> None:
        self._heartbeat.start()
        self._watcher = asyncio.create_task(self._watch(), name="batch-watcher")

    async def _watch(self) -> None:
        """Run every active batch of the store here too: those other replicas created, and
        those whose finalizer died."""
        while not self._stopping:
            try:
                for batch_id in await self._call(self.store.batch_ids, ACTIVE):
                    self.submit(batch_id)
            except Exception:
                log.warning("could not list active batches", exc_info=True)
            await asyncio.sleep(self.watch_s)

    def submit(self, batch_id: str) -> None:
        if self._stopping or batch_id in self._tasks:
            return
        self._cancel.setdefault(batch_id, asyncio.Event())
        task = asyncio.create_task(self._run(batch_id), name=f"batch-{batch_id}")
        self._tasks[batch_id] = task

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.pop(batch_id, None)
            self._cancel.pop(batch_id, None)
            self._owners.pop(batch_id, None)
            if not t.cancelled() and t.exception() is not None:
                log.error("batch %s failed", batch_id, exc_info=t.exception())

        task.add_done_callback(done)

    def cancel(self, batch_id: str) -> None:
        """The batch is already marked `cancelling` in the store; stop its work here now
        (other replicas see the status within `watch_s`)."""
        event = self._cancel.get(batch_id)
        if event is not None:
            event.set()
        else:
            self.submit(batch_id)

    async def stop(self, grace_s: float) -> None:
        """Stop launching requests; give in-flight ones `grace_s`, then abort them and hand
        their lines to the other replicas."""
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._heartbeat.stop()
        try:
            await self._call(self.store.leave, self.replica)
        except Exception:  # its claims lapse with its lease instead
            log.warning("could not hand back the lines of replica %s", self.replica, exc_info=True)

    # -- one batch -------------------------------------------------------------------------
    def _lines(self, obj: dict[str, Any]) -> tuple[list[BatchLine], list[dict[str, Any]]]:
        chunks = self.store.read_file(obj["input_file_id"], tenant=None)
        if chunks is None:
            gone = {"code": "file_not_found", "message": "the input file is gone"}
            return [], [{**gone, "param": "input_file_id", "line": None}]
        return parse_batch_file(chunks, max_lines=self.max_lines, endpoint=obj["endpoint"])

    async def _run(self, batch_id: str) -> None:
        """Take the batch from whatever status it is in to the end, or as far as this
        replica can: every step re-reads the status, since another replica may move it."""
        parsed: tuple[list[BatchLine], list[dict[str, Any]]] | None = None
        owner = await self._call(self.store.batch_tenant, batch_id)
        self._owners[batch_id] = self.tenancy.tenant(owner)
        while not self._stopping:
            obj = await self._call(self.store.get_batch, batch_id, tenant=None)
            if obj is None or obj["status"] in TERMINAL:
                return
            status = BatchStatus(obj["status"])
            if status in CLOSING and not await self._call(
                self.store.claim_finalizer, batch_id, self.replica
            ):
                return  # a live replica finalizes it
            if parsed is None:
                parsed = await self._call(self._lines, obj)
            lines, errors = parsed
            if status in CLOSING:
                await self._call(self._finalize, batch_id, obj, lines)
                return
            if status is BatchStatus.VALIDATING:
                await self._call(self._validate, batch_id, lines, errors)
            else:
                await self._execute_all(batch_id, obj, lines)

    def _validate(
        self, batch_id: str, lines: list[BatchLine], errors: list[dict[str, Any]]
    ) -> None:
        """Fail the batch or start it; whichever replica validates first decides."""
        now = int(time.time())
        if errors:
            self.store.update_batch(
                batch_id,
                expect=(BatchStatus.VALIDATING,),
                status=BatchStatus.FAILED,
                failed_at=now,
                errors={"object": "list", "data": errors[:100]},
            )
            return
        model = next((ln.body.get("model") for ln in lines), None)
        self.store.update_batch(
            batch_id,
            expect=(BatchStatus.VALIDATING,),
            status=BatchStatus.IN_PROGRESS,
            in_progress_at=now,
            model=model if isinstance(model, str) else None,
            request_counts={"total": len(lines), "completed": 0, "failed": 0},
        )

    def _close(self, batch_id: str, *, expired: bool) -> None:
        """`in_progress` → `finalizing`, with this replica as the finalizer: when every line
        has its result, or at once when the batch expired (its results freeze either way)."""
        now = int(time.time())
        fields: dict[str, Any] = {"status": BatchStatus.FINALIZING, "finalizing_at": now}
        if expired:
            fields["expired_at"] = now
        self.store.update_batch(
            batch_id,
            expect=(BatchStatus.IN_PROGRESS,),
            worker=self.replica,
            when_lines_done=not expired,
            **fields,
        )

    async def _execute_all(
        self, batch_id: str, obj: dict[str, Any], lines: list[BatchLine]
    ) -> None:
        """Claim and run lines while the batch is in progress here; return when it is not
        (closed here or elsewhere, cancelled) or when stopping."""
        by_id = {ln.custom_id: ln for ln in lines}
        await self._call(self.store.add_lines, batch_id, [(c, ln.line) for c, ln in by_id.items()])
        # No line of this batch runs here now: any this replica holds are from a past life.
        await self._call(self.store.release_lines, self.replica, batch_id)
        expires_at = obj.get("expires_at")
        cancel = self._cancel[batch_id]
        inflight: set[asyncio.Task[None]] = set()
        checked = time.monotonic()
        try:
            while not (self._stopping or cancel.is_set()):
                look = time.monotonic() - checked >= self.watch_s  # cancelled elsewhere?
                checked = time.monotonic() if look else checked
                try:
                    if not await self._step(batch_id, by_id, expires_at, inflight, look):
                        break
                except StoreError:  # in-flight lines go on; their results wait for it
                    log.warning("the store failed; batch %s waits", batch_id, exc_info=True)
                    await asyncio.sleep(self.watch_s)
            while self._stopping and inflight and not cancel.is_set():
                await asyncio.wait(inflight, timeout=self.poll_s)  # the grace period
        finally:
            for t in list(inflight):
                t.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)

    async def _step(
        self,
        batch_id: str,
        by_id: dict[str, BatchLine],
        expires_at: int | None,
        inflight: set[asyncio.Task[None]],
        look: bool,
    ) -> bool:
        """One round: check the status (when `look`) and the expiry, claim as many lines as
        there are free slots, or wait. False once the batch is not in progress here."""
        if look:
            now = await self._call(self.store.get_batch, batch_id, tenant=None)
            if now is None or now["status"] != BatchStatus.IN_PROGRESS:
                return False
        if expires_at is not None and time.time() >= expires_at:
            await self._call(self._close, batch_id, expired=True)
            return False
        free = self._capacity - self._busy
        claimed = []
        if free > 0:
            claimed = await self._call(self.store.claim_lines, batch_id, self.replica, free)
        for custom_id in claimed:
            self._launch(batch_id, by_id[custom_id], inflight)
        if claimed:
            return True
        if free > 0 and not inflight:
            if not await self._call(self.store.lines_left, batch_id):
                await self._call(self._close, batch_id, expired=False)
                return False  # closed here or by another replica: the caller reads which
            await asyncio.sleep(self.watch_s)  # the rest are other replicas' now
        elif inflight:
            await asyncio.wait(inflight, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
        else:  # other batches hold every slot
            await asyncio.sleep(self.poll_s)
        return True

    def _launch(self, batch_id: str, ln: BatchLine, inflight: set[asyncio.Task[None]]) -> None:
        self._busy += 1
        task = asyncio.create_task(self._one(batch_id, ln))
        inflight.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._busy -= 1
            inflight.discard(t)

        task.add_done_callback(done)

    async def _one(self, batch_id: str, ln: BatchLine) -> None:
        tenant = self._owners[batch_id]
        while True:
            r = await execute_line(
                self.serving, ln.url, ln.body, self.priority, tenant, self.responses
            )
            if r.status == 429:  # the engine queue is full: wait, do not fail the request
                await asyncio.sleep(0.5)
                continue
            if r.status == 503:  # shutting down: leave it for another replica or the resume
                return
            break
        if self._gate is not None:
            await self._gate.hold(ln.custom_id)
        line = result_line(ln.custom_id, r.status, r.body)
        ok = r.status == 200
        args = (batch_id, ln.custom_id, ln.line, ok, line, r.prompt_tokens, r.completion_tokens)
        while True:  # a computed answer is worth waiting for the store to come back
            try:
                written = await self._call(self.store.add_result, *args)
                break
            except StoreError:
                log.warning("could not store a result of batch %s; retrying", batch_id)
                await asyncio.sleep(1.0)
        if written:
            outcome = "completed" if ok else "failed"
            self.serving.metrics.batch_requests.labels(outcome=outcome).inc()

    def _finalize(self, batch_id: str, obj: dict[str, Any], lines: list[BatchLine]) -> None:
        """Write the output and error files from the (frozen) results and end the batch, if
        it is still this replica's to end."""
        if obj["status"] == BatchStatus.CANCELLING:
            status = BatchStatus.CANCELLED
        else:
            status = BatchStatus.EXPIRED if obj.get("expired_at") else BatchStatus.COMPLETED
        done = self.store.done_custom_ids(batch_id)
        not_run = (ln.custom_id for ln in lines if ln.custom_id not in done)
        files, named = output_files(batch_id, status, self.store.results(batch_id), not_run)
        fields: dict[str, Any] = dict(named)
        completed, failed, pt, ct = self.store.result_counts(batch_id)
        fields["request_counts"] = {"total": len(lines), "completed": completed, "failed": failed}
        fields["usage"] = batch_usage(pt, ct)
        fields[f"{status}_at"] = obj.get(f"{status}_at") or int(time.time())
        self.store.finish_batch(batch_id, self.replica, files, status=status, **fields)
