"""Crash safety: a killed client, or a crash between submit and record, never submits twice,
and the re-run returns the same results as direct calls."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from batchify_helpers import batch_ids, chat_kw
from resume_client import PROMPTS
from server_harness import LiveServer

from shoal.batchify import batchify

HERE = Path(__file__).parent


class Crash(Exception):
    """Stands for the process dying at a fault point."""


def crash_at(point: str) -> Any:
    def hook(at: str) -> None:
        if at == point:
            raise Crash(at)

    return hook


async def _direct(client: openai.AsyncOpenAI, model: str) -> list[str | None]:
    return [
        (await client.chat.completions.create(**chat_kw(model, p))).choices[0].message.content
        for p in PROMPTS
    ]


async def _run(client: openai.AsyncOpenAI, model: str, **kw: Any) -> list[Any]:
    async with batchify(**kw):
        return await asyncio.gather(
            *(client.chat.completions.create(**chat_kw(model, p)) for p in PROMPTS),
            return_exceptions=True,
        )


@pytest.mark.parametrize(
    ("point", "batches_created"),
    [("submitted", 1), ("intent_written", 0)],
)
async def test_crash_between_steps_then_rerun_submits_once(
    server: LiveServer,
    aclient: openai.AsyncOpenAI,
    scope_kw: dict[str, Any],
    point: str,
    batches_created: int,
) -> None:
    direct = await _direct(aclient, server.model)
    before = set(batch_ids(server.url))
    crashed = await _run(aclient, server.model, fault_hook=crash_at(point), **scope_kw)
    assert all(isinstance(g, Crash) for g in crashed)
    assert len(set(batch_ids(server.url)) - before) == batches_created

    # The re-run adopts the orphan (tagged with the intent) or, if none exists, submits once.
    rerun = await _run(aclient, server.model, **scope_kw)
    assert [g.choices[0].message.content for g in rerun] == direct
    assert len(set(batch_ids(server.url)) - before) == 1

    third = await _run(aclient, server.model, **scope_kw)  # everything is cached now
    assert [g.choices[0].message.content for g in third] == direct
    assert len(set(batch_ids(server.url)) - before) == 1


def _recorded_batch(cache: Path) -> str | None:
    if not cache.exists():
        return None
    try:
        with sqlite3.connect(cache, timeout=1) as db:
            row = db.execute("SELECT batch_id FROM intents WHERE batch_id IS NOT NULL").fetchone()
    except sqlite3.OperationalError:  # the schema is not there yet
        return None
    return None if row is None else str(row[0])


async def test_kill_9_after_submission_then_rerun(
    server: LiveServer, aclient: openai.AsyncOpenAI, tmp_path: Path
) -> None:
    direct = await _direct(aclient, server.model)
    cache, out = tmp_path / "cache.sqlite3", tmp_path / "out.json"
    before = set(batch_ids(server.url))
    script = [sys.executable, str(HERE / "resume_client.py"), server.url, server.model, str(cache)]
    # A 60 s poll interval: the client is certainly still waiting when it is killed.
    proc = subprocess.Popen([*script, "60", str(out)])
    try:
        deadline = time.monotonic() + 60
        while _recorded_batch(cache) is None:
            assert proc.poll() is None and time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -9 and not out.exists()
    assert len(set(batch_ids(server.url)) - before) == 1

    rerun = subprocess.run([*script, "0.05", str(out)], timeout=120)
    assert rerun.returncode == 0
    result = json.loads(out.read_text())
    assert result["replies"] == direct
    assert (result["batches"], result["hits"]) == (0, len(PROMPTS))
    assert len(set(batch_ids(server.url)) - before) == 1
