"""Claude Code, unchanged, against shoal: one `claude -p` turn through `/v1/messages` (its
per-request billing line stripped, so a second run reads its long system prompt from the KV
store). Skipped, with the reason, where `make claude-code` could not install it."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agent_clients
import httpx
import pytest
from server_harness import LiveServer
from server_tiny_model import build_tiny_model

CLAUDE = agent_clients.claude_code()
pytestmark = pytest.mark.skipif(
    CLAUDE is None, reason=agent_clients.NOT_INSTALLED.format("Claude Code", "claude-code")
)


@pytest.fixture(scope="module")
def long_server(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    """A tiny random model with a context long enough for Claude Code's system prompt (its
    byte-level tokenizer makes many tokens of it), whose final norm is zeroed: every logit is
    0, so a sampled answer ends at EOS after a few hundred tokens rather than at 32,000."""
    from safetensors.torch import load_file, save_file

    model = build_tiny_model(tmp_path_factory.mktemp("tiny-long-context"), max_positions=65_536)
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"].zero_()
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    engine = {"model": str(model), "num_blocks": 8192, "max_num_batched_tokens": 8192}
    return start_server(engine=engine)


def claude_turn(server: LiveServer, home: Path) -> dict[str, Any]:
    assert CLAUDE is not None
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": server.model,
        "ANTHROPIC_SMALL_FAST_MODEL": server.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": server.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    # Its default system prompt, without the tools' long schemas (`--tools ""`).
    argv = [CLAUDE, "-p", "Say hello.", "--model", server.model, "--output-format", "json"]
    proc = subprocess.run(
        [*argv, "--tools", ""],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


def test_claude_code_runs_a_turn_and_its_prompt_is_cached(
    long_server: LiveServer, tmp_path: Path
) -> None:
    first = claude_turn(long_server, tmp_path)
    assert first.get("type") == "result" and not first.get("is_error"), first
    second = claude_turn(long_server, tmp_path)
    usage = second.get("usage") or {}
    assert usage.get("cache_read_input_tokens", 0) > 0, second
    metrics = httpx.get(f"{long_server.url}/metrics", timeout=30).text
    assert "shoal_kv_host_blocks" in metrics
