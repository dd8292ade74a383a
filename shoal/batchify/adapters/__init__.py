"""Provider adapters, and the test that turns an intercepted request into a `Call`."""

from __future__ import annotations

import json
from typing import Any

from shoal.batchify.adapters.anthropic import AnthropicAdapter
from shoal.batchify.adapters.base import Adapter, Candidate, Results, Route, Snapshot
from shoal.batchify.adapters.openai import OpenAIAdapter
from shoal.batchify.calls import Call, Target, canonical_json, sha256_hex
from shoal.batchify.errors import BatchifyError

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (OpenAIAdapter(), AnthropicAdapter())}
# Room for a batch line's envelope (custom_id, method, url) around the body.
LINE_OVERHEAD = 160


def to_call(request: Any) -> Call | None:
    """The `Call` for an `httpx`/`httpx2` request that has a batch equivalent, else None.

    Only a JSON object body that is fully in memory qualifies; `stream: true`, a background
    response, multipart, query strings (the batch calls could not carry them) and other
    paths pass through.
    """
    url = request.url
    if url.query or not request.headers.get("content-type", "").startswith("application/json"):
        return None
    for adapter in ADAPTERS.values():
        route = adapter.route(request.method, str(url))
        if route is not None:
            break
    else:
        return None
    try:
        content = request.content
        body = json.loads(content)
    except Exception:  # a streamed body (not read) or not JSON: not ours to batch
        return None
    if not isinstance(body, dict) or body.get("stream") or body.get("background"):
        return None
    target = Target(
        adapter.name, route.base_url, route.endpoint, adapter.account_headers(request.headers)
    )
    fingerprint = sha256_hex(canonical_json([adapter.name, route.base_url, route.endpoint, body]))
    return Call(
        target=target,
        model=str(body.get("model")),
        body=body,
        line_bytes=len(content) + LINE_OVERHEAD,
        fingerprint=fingerprint,
    )


_MIXED: dict[tuple[type, type], type[BatchifyError]] = {}


def _mixed(cls: type[BatchifyError], base: type[Exception]) -> type[BatchifyError]:
    key = (cls, base)
    if key not in _MIXED:
        _MIXED[key] = type(cls.__name__, (cls, base), {"__module__": cls.__module__})
    return _MIXED[key]


def for_sdk(error: BaseException, adapter: str) -> BaseException:
    """`error` as the caller's SDK should see it: a typed batchify error that, for an SDK
    which would wrap it in a connection error and retry, is also that SDK's own error."""
    base = ADAPTERS[adapter].sdk_error_base()
    if base is None or not isinstance(error, BatchifyError) or isinstance(error, base):
        return error
    cls = _mixed(type(error), base)
    mixed = cls.__new__(cls)
    mixed.__dict__.update(error.__dict__)
    mixed.args = error.args
    return mixed


__all__ = [
    "ADAPTERS",
    "Adapter",
    "AnthropicAdapter",
    "Candidate",
    "OpenAIAdapter",
    "Results",
    "Route",
    "Snapshot",
    "for_sdk",
    "to_call",
]
