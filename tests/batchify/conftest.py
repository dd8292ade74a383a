"""Batchify tests run the official SDKs against the shared live `shoal serve` (tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import LiveServer

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


@pytest.fixture
def scope_kw(tmp_path: Path) -> dict[str, Any]:
    return {**FAST, "cache_path": tmp_path / "batchify.sqlite3"}


@pytest.fixture
def aclient(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0)


def chat_kw(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
