"""`Ingress`: the cluster's HTTP entry, a Ray Serve deployment in front of the engine replicas.

Every path `shoal serve` answers (OpenAI, Anthropic, Files and Batch APIs, health) is
forwarded whole to one replica through a `DeploymentHandle`, whose `SessionAffinityRouter`
picks the replica from the request's `Route` (`routing.route_for`: session id, prompt prefix,
the batch API's one home, or load alone when the replicas share a batch store). The answer
streams back as the replica's app sent it: status, headers (plus `x-shoal-replica`), body
chunks, SSE included. `/metrics` gathers every live replica's metrics with a `replica` label
and adds the session placement counts (behind `--metrics-key` when set). With `--keys`, a
request's route is in its tenant's namespace, as the replicas name its sessions.

A replica that dies before answering is retried once on another; if none answers, the client
gets a 503 with `Retry-After` in its API's error shape, which the official SDKs retry. A stream
cut by a replica's death ends early (what was sent cannot be taken back).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shoal.cluster import metrics
from shoal.cluster.asgi import Forwarded, ResponseHead
from shoal.cluster.replica import REPLICA_HEADER
from shoal.cluster.routing import HOMES, SESSION_HEADER, STATS, Route, route_for
from shoal.server.errors import APIError, error_response
from shoal.server.middleware import presented_key
from shoal.server.tenancy import Tenancy

log = logging.getLogger("shoal.cluster")
RETRIES = 1  # another replica after one that died before answering
METRICS_TIMEOUT_S = 10.0


class Ingress:
    def __init__(
        self,
        replicas: DeploymentHandle,
        max_body_bytes: int,
        shared_store: bool = False,
        *,
        api_key: str | None = None,
        keys_file: str | None = None,
        metrics_key: str | None = None,
    ) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.shared_store = shared_store
        self.tenancy = Tenancy(api_key, Path(keys_file)) if keys_file else None
        self.metrics_key = metrics_key

    def _tenant(self, request: Request) -> str | None:
        """The request's tenant with `--keys` (None: unkeyed, or a key the replica refuses)."""
        if self.tenancy is None:
            return None
        tenant = self.tenancy.authenticate(presented_key({"headers": request.headers.raw}))
        return tenant.name if tenant is not None else None

    def _metrics_allowed(self, request: Request) -> bool:
        if self.metrics_key is None:
            return True
        key = presented_key({"headers": request.headers.raw}) or b""
        want = hashlib.sha256(self.metrics_key.encode()).digest()
        return hmac.compare_digest(hashlib.sha256(key.strip()).digest(), want)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        body = await request.body()
        if len(body) > self.max_body_bytes:
            return error_response(APIError(413, "request body too large"), path)
        if request.method == "GET" and path == "/metrics":
            if not self._metrics_allowed(request):
                return error_response(APIError(401, "Incorrect API key provided."), path)
            return Response(await self.metrics(), media_type="text/plain; version=0.0.4")
        headers = {k.lower(): v for k, v in request.headers.items()}
        tenant = self._tenant(request)
        route = route_for(request.method, path, headers, body, self.shared_store, tenant)
        forwarded = Forwarded(
            request.method, path, request.url.query.encode(), request.headers.raw, body
        )
        for attempt in range(RETRIES + 1):
            stream = self._send(forwarded, route=route)
            try:
                head = await stream.__anext__()
            except RayActorError as e:
                log.warning("replica died before answering (attempt %d): %s", attempt + 1, e)
                continue
            except StopAsyncIteration:
                break
            assert isinstance(head, ResponseHead)
            answer_headers = dict(head.headers)
            replica = answer_headers.get(REPLICA_HEADER.encode(), b"").decode()
            STATS.routed(route, replica)
            # A moved turn's KV is there now; a new response chain (its id in the answer's
            # X-Session-Id) lives where its first response was answered.
            named = answer_headers.get(SESSION_HEADER.encode(), b"").decode() or None
            named = Route(session_id=named).within(tenant).session_id
            for session_id in {route.session_id, named} - {None}:
                if replica:
                    HOMES.settle(str(session_id), replica)
            response = StreamingResponse(_body(stream), status_code=head.status)
            response.raw_headers = head.headers
            return response
        unavailable = APIError(
            503, "no engine replica could answer; retry", headers={"Retry-After": "1"}
        )
        return error_response(unavailable, path)

    def _send(self, request: Forwarded, route: Route) -> DeploymentResponseGenerator[Any]:
        return cast(
            DeploymentResponseGenerator[Any], self.replicas.handle.remote(request, route=route)
        )

    async def metrics(self) -> bytes:
        """Every live replica's `/metrics`, labelled, and the routing counts."""
        if not STATS.replicas:  # the handle's router learns the replicas on its first request
            await _collect(self._send(Forwarded("GET", "/health"), route=Route()))
        found: dict[str, str] = {}
        for replica in list(STATS.replicas):
            # One at a time: the calls one request makes share its id, and Ray Serve's router
            # matches a chosen replica to a waiting call by that id.
            text = await self._metrics_of(replica)
            if text is not None:
                found[replica] = text
        return metrics.merge(found, STATS.snapshot())

    async def _metrics_of(self, replica: str) -> str | None:
        pinned = Route(replica=replica)
        key = [(b"x-api-key", self.metrics_key.encode())] if self.metrics_key else []
        stream = self._send(Forwarded("GET", "/metrics", headers=key), route=pinned)
        try:
            parts = await asyncio.wait_for(_collect(stream), METRICS_TIMEOUT_S)
        except (TimeoutError, RayActorError) as e:
            log.warning("no metrics from replica %s: %s", replica, e)
            stream.cancel()
            return None
        return b"".join(p for p in parts if isinstance(p, bytes)).decode()


async def _collect(stream: DeploymentResponseGenerator[Any]) -> list[Any]:
    return [part async for part in stream]


async def _body(stream: DeploymentResponseGenerator[Any]) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    except RayActorError as e:
        log.warning("replica died mid-answer: %s", e)
    finally:
        stream.cancel()  # the client left (or the answer ended): the replica aborts its work
