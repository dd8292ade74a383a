"""`shoal sessions`: what a running server's KV store holds, tier by tier (`GET /v1/kv`)."""

from __future__ import annotations

import argparse
import json
import sys

from shoal.cli.formatting import examples


def add_sessions(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ses = sub.add_parser(
        "sessions",
        help="list what a server's KV store holds, tier by tier",
        description="Print a running server's KV tiers (pool, host memory, disk, shared "
        "folder), its sessions and its pins (prompt cache keys, cache_control breakpoints).",
        epilog=examples(
            "shoal sessions",
            "shoal sessions --url http://10.0.0.5:8000 --api-key secret --json",
        ),
    )
    ses.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    ses.add_argument("--api-key", default=None, help="the server's --api-key")
    ses.add_argument("--json", action="store_true", help="print GET /v1/kv's answer as it is")
    ses.set_defaults(func=_sessions)


def _sessions(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.get(f"{args.url.rstrip('/')}/v1/kv", headers=headers, timeout=30)
    if r.status_code != 200:
        print(f"shoal sessions: {r.status_code} {r.text}", file=sys.stderr)
        return 1
    body = r.json()
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    for name, t in body.get("tiers", {}).items():  # (a tenant of --keys sees no tiers)
        facts = ", ".join(f"{k} {v}" for k, v in t.items())
        print(f"{name:7} {facts}")
    for s in body["sessions"]:
        where = "pool" if s["in_memory"] else "store"
        print(f"session {s['session_id']}: {s['state']}, {s['num_tokens']} tokens, in the {where}")
    for p in body["pins"]:
        print(f"pin     {p['name']}: {p['blocks']} blocks, expires {p['expires']}")
    return 0
