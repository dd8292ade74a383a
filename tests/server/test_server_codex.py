"""Codex CLI, unchanged, against `shoal serve`: `codex exec` with a custom model provider
(`wire_api = "responses"`, the only wire API it speaks) completes a turn.

Codex sends its whole agent prompt (about 11k SmolLM2 tokens: more than SmolLM2's 8,192-token
context), developer messages, function tools inside a `namespace`, a `web_search` tool shoal
cannot run (dropped with a warning), reasoning and `include` fields, `store: false` and
`stream: true`, and reads tool calls from `response.output_item.done`. So the model here is
a tiny random one with SmolLM2's tokenizer and a 32k context, whose answer ends at once (a
cut-off answer is a failure to Codex); the test checks the protocol, not the words.

The binary comes from `make codex` (npm's `@openai/codex`, into .tools/codex), or
`SHOAL_CODEX`, or the PATH (`agent_clients.py`); the test skips, saying so, only where none
is installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import agent_clients
import httpx
import pytest
from server_harness import LiveServer
from server_tiny_model import build_terse_smollm2_model

SMOLLM2_CONTEXT = 8192


def _codex() -> str:
    found = agent_clients.codex()
    if not found:
        pytest.skip(agent_clients.NOT_INSTALLED.format("Codex CLI", "codex"))
    return found


@pytest.fixture(scope="module")
def live(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    model = build_terse_smollm2_model(tmp_path_factory.mktemp("codex-model"))
    return start_server(engine={"model": str(model), "num_blocks": 4096})


def _stops(live: LiveServer) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    m = re.search(r'^shoal_requests_total\{finish_reason="stop"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_codex_exec_completes_a_turn(live: LiveServer, tmp_path: Path) -> None:
    codex = _codex()
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        f"""
model = "{live.model}"
model_provider = "shoal"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.shoal]
name = "shoal"
base_url = "{live.url}/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""
    )
    env = {**os.environ, "CODEX_HOME": str(home)}
    stops = _stops(live)
    done = subprocess.run(
        [codex, "exec", "--json", "--skip-git-repo-check", "-C", str(work), "Say hello."],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    completed = [e for e in events if e.get("type") == "turn.completed"]
    assert completed, done.stdout[-3000:]
    usage = completed[-1]["usage"]
    assert usage["input_tokens"] > SMOLLM2_CONTEXT  # what shoal counted: Codex's whole prompt
    assert _stops(live) == stops + 1  # one answer, ended by the model
