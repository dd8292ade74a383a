"""Sync clients, the `shoal batchify` command, and the import without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import openai
from batchify_helpers import batch_ids, chat_kw
from server_harness import LiveServer
from sync_script import PROMPTS

from shoal.batchify import batchify

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def test_sync_client_in_the_scope_thread(server: LiveServer, scope_kw: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0)
    direct = client.chat.completions.create(**chat_kw(server.model, "sync"))
    before = set(batch_ids(server.url))
    with batchify(**scope_kw) as b:
        got = client.chat.completions.create(**chat_kw(server.model, "sync"))
    assert got.choices[0].message.content == direct.choices[0].message.content
    assert b.stats.batches == 1 and len(set(batch_ids(server.url)) - before) == 1


def test_sync_responses_create_in_the_scope_thread(
    server: LiveServer, scope_kw: dict[str, Any]
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0)
    kw = {"model": server.model, "input": "sync", "temperature": 0, "max_output_tokens": 4}
    direct = client.responses.create(**kw)
    with batchify(**scope_kw) as b:
        got = client.responses.create(**kw)
    assert got.output_text == direct.output_text and got.object == "response"
    assert b.stats.batches == 1 and b.stats.calls == 1


def test_cli_runs_an_unmodified_threaded_sync_script(server: LiveServer, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0)
    direct = [
        client.chat.completions.create(**chat_kw(server.model, p)).choices[0].message.content
        for p in PROMPTS
    ]
    before = set(batch_ids(server.url))
    cmd = [
        sys.executable,
        "-m",
        "shoal.cli",
        "batchify",
        "--batch-size",
        str(len(PROMPTS)),
        "--window-s",
        "30",  # a full queue goes at once; the window would take 30 s
        "--poll-interval-s",
        "0.05",
        "--cache-path",
        str(tmp_path / "c.sqlite3"),
        str(HERE / "sync_script.py"),
        server.url,
        server.model,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == direct
    assert len(set(batch_ids(server.url)) - before) == 1


def test_imports_and_runs_without_torch() -> None:
    """The client machine has no model stack: torch, numpy and transformers cannot load."""
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "numpy", "transformers"):
                    raise ImportError(f"{name} is not installed here")
                return None

        sys.meta_path.insert(0, Block())
        import shoal.batchify
        import shoal.cli
        from shoal.batchify import batchify

        with batchify(dry_run=True, live_progress=False) as b:
            pass
        bad = [m for m in sys.modules if m.startswith(("shoal.engine", "shoal.llm"))]
        assert not bad, bad
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
