"""JSON shapes of design input 004's HTTP API, both ways, for the server and the client.

Parsing an item checks only its shape (field names and JSON types); the service checks the
values. An item of the wrong shape becomes `Malformed`, which answers `invalid_request` in
its place, so one bad item never fails its batch.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from shoal.quota.errors import QuotaTransportError
from shoal.quota.types import (
    Actual,
    CompleteRequest,
    CompleteResult,
    Malformed,
    Requirement,
    ReserveRequest,
    ReserveResult,
    Usage,
)


def _fields(obj: Any, required: set[str], optional: set[str]) -> bool:
    return isinstance(obj, dict) and required <= obj.keys() <= required | optional


def _pairs(items: Any, amount: str) -> list[tuple[Any, Any]] | None:
    if not isinstance(items, list) or not all(_fields(x, {"key", amount}, set()) for x in items):
        return None
    return [(x["key"], x[amount]) for x in items]


def reserve_from_wire(obj: Any) -> ReserveRequest | Malformed:
    if not _fields(obj, {"lease_id", "requirements"}, {"job_id"}):
        return Malformed("a reserve item has lease_id, requirements and optionally job_id")
    pairs = _pairs(obj["requirements"], "amount")
    if pairs is None:
        return Malformed("each requirement is {key, amount}")
    reqs = tuple(Requirement(k, a) for k, a in pairs)
    return ReserveRequest(obj["lease_id"], reqs, obj.get("job_id", ""))


def complete_from_wire(obj: Any) -> CompleteRequest | Malformed:
    if not _fields(obj, {"lease_id"}, {"job_id", "actuals"}):
        return Malformed("a complete item has lease_id and optionally job_id and actuals")
    pairs = _pairs(obj.get("actuals", []), "actual_amount")
    if pairs is None:
        return Malformed("each actual is {key, actual_amount}")
    actuals = tuple(Actual(k, a) for k, a in pairs)
    return CompleteRequest(obj["lease_id"], actuals, obj.get("job_id", ""))


def to_wire(
    value: ReserveRequest | CompleteRequest | ReserveResult | CompleteResult | Usage,
) -> Any:
    return asdict(value)


def _result(obj: Any, cls: type[Any], fields: dict[str, Any]) -> Any:
    if not isinstance(obj, dict) or not all(isinstance(obj.get(f), t) for f, t in fields.items()):
        raise QuotaTransportError(f"the quota service sent a malformed result: {obj!r:.200}")
    return cls(**{f: obj[f] for f in fields})


def reserve_results(body: Any, count: int) -> list[ReserveResult]:
    fields = {"allowed": bool, "retry_after_ms": int, "reserved_at_unix_ms": int, "error": str}
    return [_result(x, ReserveResult, fields) for x in _results(body, count)]


def complete_results(body: Any, count: int) -> list[CompleteResult]:
    return [_result(x, CompleteResult, {"ok": bool, "error": str}) for x in _results(body, count)]


def _results(body: Any, count: int) -> list[Any]:
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or len(results) != count:
        raise QuotaTransportError(f"the quota service sent no {count} results")
    return results


def usage_from_wire(body: Any) -> list[Usage]:
    fields = {"key": str, "kind": str, "capacity": int, "window_s": float | int, "used": int}
    rows = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise QuotaTransportError("the quota service sent no usage list")
    return [_result(x, Usage, fields) for x in rows]
