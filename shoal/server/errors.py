"""OpenAI-shaped error objects and the exception handlers that produce them.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with a
status the official SDKs map to their typed exceptions.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.errors import (
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    ShoalError,
)
from shoal.server.anthropic.formatting import error_body as anthropic_error_body
from shoal.server.store import StoreError

log = logging.getLogger("shoal.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status, raised by handlers and turned into OpenAI JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"  # every error under it leaves in Anthropic's shape


def body_for(path: str, status: int, message: str, **openai_fields: Any) -> dict[str, Any]:
    """The error body a client of `path` expects: Anthropic's or OpenAI's."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    return error_body(status, message, **openai_fields)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    body = body_for(path, err.status, err.message, param=err.param, code=err.code)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def to_api_error(e: BaseException) -> APIError:
    """The one place an exception becomes an HTTP error: the engine's typed errors get their
    status, anything unexpected is a 500 that names only its type."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), param="prompt", code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):  # a schema refusal names its place
        return APIError(400, str(e), param=getattr(e, "param", None))
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineClosedError):
        return APIError(503, str(e), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, StoreError):  # the database is away for a moment (or for good)
        return APIError(503, str(e), code="store_unavailable", headers={"Retry-After": "5"})
    if isinstance(e, ShoalError):
        return APIError(500, f"engine error: {e}")
    return APIError(500, f"internal error: {type(e).__name__}")


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"No {what} found with id '{ident}'.", param=param, code="not_found")


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def _loc(err: dict[str, Any]) -> str:
    parts = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    return ".".join(parts)


def install_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc), request.url.path)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
            message = f"We could not parse the JSON body of your request: {detail}"
            return error_response(APIError(400, message), request.url.path)
        first = errors[0] if errors else {}
        param = _loc(first) or None
        message = "; ".join(f"{_loc(e) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:5])
        # Bad bodies, queries and paths are all 400s, as with OpenAI.
        err = APIError(400, message or "invalid request", param=param)
        return error_response(err, request.url.path)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return error_response(err, request.url.path)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(to_api_error(exc), request.url.path)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ShoalError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
