"""Batchify tests run the official SDKs against the shared live `shoal serve` (tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from batchify_helpers import FAST
from server_harness import LiveServer


@pytest.fixture
def scope_kw(tmp_path: Path) -> dict[str, Any]:
    return {**FAST, "cache_path": tmp_path / "batchify.sqlite3"}


@pytest.fixture
def aclient(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0)
