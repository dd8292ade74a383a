"""Interception at the HTTP transport: the SDKs stay unmodified and unpatched.

While at least one scope is open, `AsyncHTTPTransport.handle_async_request` and
`HTTPTransport.handle_request` of `httpx` and of `httpx2` (which current `openai` and
`anthropic` releases use) are wrapped. A request that the active scope wants becomes a `Call`;
its caller gets back a response object of its own library, built from the batch result, and
every other request (other paths, GET, streaming, multipart, outside any scope, the batcher's
own calls) goes to the real transport untouched.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import ModuleType
from typing import Any, Protocol

from shoal.batchify.adapters import for_sdk
from shoal.batchify.calls import Call, Outcome
from shoal.batchify.errors import BatchifyError
from shoal.batchify.provider import INTERNAL


class Interceptor(Protocol):
    def intercept(self, request: Any) -> Call | None: ...

    def submit(self, call: Call) -> Future[Outcome]: ...

    def submit_async(self, call: Call) -> asyncio.Future[Outcome]: ...


Resolver = Callable[[], Interceptor | None]

_LIBRARIES = ("httpx", "httpx2")
_lock = threading.Lock()
_installed: list[tuple[type, str, Any]] = []  # (class, method name, original)
_users = 0


def _response(module: ModuleType, request: Any, outcome: Outcome) -> Any:
    return module.Response(
        outcome.status_code, headers=outcome.headers, content=outcome.body, request=request
    )


def _wanted(resolve: Resolver, request: Any) -> tuple[Interceptor, Call] | None:
    if request.extensions.get(INTERNAL):
        return None
    scope = resolve()
    if scope is None:
        return None
    call = scope.intercept(request)
    return None if call is None else (scope, call)


def _async_hook(module: ModuleType, original: Any, resolve: Resolver) -> Any:
    async def handle_async_request(self: Any, request: Any) -> Any:
        wanted = _wanted(resolve, request)
        if wanted is None:
            return await original(self, request)
        scope, call = wanted
        try:
            outcome = await scope.submit_async(call)
        except BatchifyError as e:
            raise for_sdk(e, call.target.adapter) from None
        return _response(module, request, outcome)

    return handle_async_request


def _sync_hook(module: ModuleType, original: Any, resolve: Resolver) -> Any:
    def handle_request(self: Any, request: Any) -> Any:
        wanted = _wanted(resolve, request)
        if wanted is None:
            return original(self, request)
        scope, call = wanted
        try:
            outcome = scope.submit(call).result()
        except BatchifyError as e:
            raise for_sdk(e, call.target.adapter) from None
        return _response(module, request, outcome)

    return handle_request


def install(resolve: Resolver) -> None:
    """Wrap the transports (once, however many scopes are open)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for name in _LIBRARIES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for cls, method, make in (
                (module.AsyncHTTPTransport, "handle_async_request", _async_hook),
                (module.HTTPTransport, "handle_request", _sync_hook),
            ):
                original = cls.__dict__[method]
                _installed.append((cls, method, original))
                setattr(cls, method, make(module, original, resolve))


def uninstall() -> None:
    """Restore the transports once the last scope has closed."""
    global _users
    with _lock:
        _users -= 1
        if _users > 0:
            return
        while _installed:
            cls, method, original = _installed.pop()
            setattr(cls, method, original)
