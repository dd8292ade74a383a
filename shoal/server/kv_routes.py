"""`GET /v1/kv`: what each tier of the KV store holds (`shoal sessions` prints it).

The pool, host memory, disk and the shared folder with their blocks, bytes and traffic
(the same figures as `/metrics`), every session and where its KV is, and the named pins
(sessions, cache keys, `cache_control` breakpoints with their expiry). Read on the step thread
(`AsyncEngine.call`), so it is one consistent picture. With `--keys` a tenant sees only its own
sessions and cache keys, by its own names, and no tiers (the operator's view is `/metrics`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from shoal.engine.protocol import EngineProtocol
from shoal.server.state import ServerState, get_state
from shoal.server.tenancy import Tenant, get_tenant

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Caller = Annotated[Tenant, Depends(get_tenant)]


def snapshot(engine: EngineProtocol) -> dict[str, Any]:
    s = engine.stats()
    store = engine.sessions.store
    tier: dict[str, dict[str, Any]] = {
        "pool": {"blocks": s.blocks_used, "bytes": s.kv_bytes_used, "free": s.blocks_free},
        "host": {
            "blocks": s.kv_host_blocks,
            "bytes": s.kv_host_bytes,
            "limit_bytes": store.host.cap_bytes,
        },
        "disk": {
            "blocks": s.kv_disk_blocks,
            "bytes": s.kv_disk_bytes,
            "limit_bytes": store.disk.cap_bytes,
            "persistent": store.disk.persistent,
        },
    }
    for name in ("host", "disk", "shared"):
        entry = tier.setdefault(name, {})
        entry.update(
            hits=getattr(s, f"kv_{name}_hits"), promotions=getattr(s, f"kv_{name}_promotions")
        )
    tier["host"]["demotions"] = s.kv_host_demotions
    tier["disk"]["demotions"] = s.kv_disk_demotions
    if store.shared is not None:
        tier["shared"].update(folder=str(store.shared.files.dir.parent), pending=s.tier_pending)
    pins = [
        {"name": p.name, "blocks": len(p.hashes), "expires": p.expires} for p in store.pins.items()
    ]
    sessions = [dataclasses.asdict(i) for i in engine.list_sessions()]
    return {"object": "kv_store", "tiers": tier, "sessions": sessions, "pins": pins}


def own_view(view: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
    """What of `view` is the tenant's: its sessions and named pins, by its own names."""
    sessions = []
    for s in view["sessions"]:
        if (mine := tenant.own(s["session_id"])) is not None:
            sessions.append({**s, "session_id": mine})
    pins = []
    for p in view["pins"]:
        kind, _, rest = p["name"].partition(":")
        api, _, key = rest.partition(":") if kind == "key" else ("", "", rest)
        if kind in ("session", "key") and (mine := tenant.own(key)) is not None:
            pins.append({**p, "name": ":".join(x for x in (kind, api, mine) if x)})
    return {"object": "kv_store", "sessions": sessions, "pins": pins}


@router.get("/v1/kv")
async def kv_store(state: State, tenant: Caller) -> dict[str, Any]:
    view = await state.serving.aeng.call(snapshot, state.engine)
    return own_view(view, tenant) if state.tenancy.keyed else view
