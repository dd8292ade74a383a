"""The quota service over HTTP: design input 004's routes as a FastAPI router and app.

`POST /v1/reserve/batch` and `/v1/complete/batch` answer 200 with one result per item, in
order, unless the batch itself is malformed (not JSON, unknown top-level field, 0 or more than
`max_batch` items): then 400 with an OpenAI-style error and nothing changed. `POST
/v1/reserve` and `/v1/complete` take one item and answer its result. `GET`/`PUT /v1/limits`,
`GET /v1/usage` and `GET /health` complete the set; the standalone app adds `GET /metrics`.
Handlers are plain functions: FastAPI runs them in its thread pool, where a blocking SQLite or
Redis call cannot stall the loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Body, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from shoal.quota.metrics import QuotaMetrics
from shoal.quota.service import QuotaService
from shoal.quota.wire import complete_from_wire, reserve_from_wire, to_wire
from shoal.server.errors import install_handlers
from shoal.server.middleware import Guard
from shoal.server.tenancy import Tenancy

MiB = 1 << 20


class BatchBody(BaseModel):
    """The envelope only: items are parsed one by one, so a bad one fails alone."""

    model_config = ConfigDict(extra="forbid")
    requests: list[Any]


class LimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: list[Any]


def create_router(service: QuotaService, *, health: bool = True) -> APIRouter:
    """The quota routes; `health=False` when mounting beside an app with its own `/health`."""
    router = APIRouter(tags=["quota"])

    @router.post("/v1/reserve/batch")
    def reserve_batch(body: BatchBody) -> JSONResponse:
        results = service.batch_reserve([reserve_from_wire(x) for x in body.requests])
        return JSONResponse({"results": [to_wire(r) for r in results]})

    @router.post("/v1/complete/batch")
    def complete_batch(body: BatchBody) -> JSONResponse:
        results = service.batch_complete([complete_from_wire(x) for x in body.requests])
        return JSONResponse({"results": [to_wire(r) for r in results]})

    @router.post("/v1/reserve")
    def reserve(body: dict[str, Any] = Body(...)) -> JSONResponse:  # noqa: B008
        return JSONResponse(to_wire(service.reserve(reserve_from_wire(body))))

    @router.post("/v1/complete")
    def complete(body: dict[str, Any] = Body(...)) -> JSONResponse:  # noqa: B008
        return JSONResponse(to_wire(service.complete(complete_from_wire(body))))

    @router.get("/v1/limits")
    def get_limits() -> dict[str, Any]:
        return {"limits": [lim.to_dict() for lim in service.limits()]}

    @router.put("/v1/limits")
    def put_limits(body: LimitsBody) -> dict[str, Any]:
        return {"limits": [lim.to_dict() for lim in service.put_limits(body.limits)]}

    @router.get("/v1/usage")
    def usage() -> dict[str, Any]:
        return {"usage": [to_wire(u) for u in service.usage()]}

    if health:

        @router.get("/health")
        def health_check() -> dict[str, Any]:
            service.usage()  # reaches the backend: a dead Redis is not healthy
            return {"status": "ok", "backend": service.backend.name}

    return router


def create_app(
    service: QuotaService, *, api_key: str | None = None, max_body_bytes: int = 8 * MiB
) -> FastAPI:
    """A standalone quota server with its Prometheus `/metrics`; it closes the service when
    it stops."""
    metrics = service.metrics = service.metrics or QuotaMetrics(service)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="shoal quota", version="0.1.0", lifespan=lifespan)
    install_handlers(app)
    app.include_router(create_router(service))

    @app.get("/metrics")
    def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(
        Guard,
        tenancy=Tenancy(api_key),
        metrics_key=None,
        max_body=max_body_bytes,
        max_upload=max_body_bytes,
    )
    return app
