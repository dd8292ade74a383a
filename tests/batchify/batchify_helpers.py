"""Helpers shared by the batchify tests (plain functions and settings, not fixtures)."""

from __future__ import annotations

from typing import Any

import httpx

# Fast settings: a short window, quick polls; no live display in tests.
FAST: dict[str, Any] = {
    "window_s": 0.2,
    "poll_interval_s": 0.05,
    "max_poll_interval_s": 0.2,
    "live_progress": False,
}


def batch_ids(url: str) -> list[str]:
    """Every batch the server holds, newest first (`GET /v1/batches`, all pages)."""
    ids: list[str] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = httpx.get(f"{url}/v1/batches", params=params, timeout=30).json()
        ids += [b["id"] for b in page["data"]]
        if not page["has_more"]:
            return ids
        params["after"] = page["last_id"]


def chat_kw(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
