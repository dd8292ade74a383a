"""`shoal quota serve` as a user runs it: a real process serving a limits file (SQLite in the
data dir; `--backend URL` goes to the same `QuotaService.open` that test_quota_limits covers),
its `/metrics`, and a one-line message with exit code 2 for what it cannot start on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from quota_helpers import ISSUE_EXAMPLE

from shoal.cli import main
from shoal.quota import QuotaClient, Requirement
from shoal.quota.testing import free_port


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            return dict(httpx.get(f"{url}/health", timeout=1).json())
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("shoal quota serve did not come up")


def test_quota_serve_serves_a_limits_file(tmp_path: Path) -> None:
    config = tmp_path / "limits.toml"
    config.write_text(ISSUE_EXAMPLE)
    port = free_port()
    args = [sys.executable, "-m", "shoal.cli", "quota", "serve", "--config", str(config)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        health = _wait_healthy(url, proc)
        assert health == {"status": "ok", "backend": "sqlite"}
        with QuotaClient.http(url) as client:
            with client.lease(
                [
                    Requirement("global:llm:openai:gpt-4o:rpm", 1),
                    Requirement("global:jobs:concurrency", 1),
                ]
            ):
                held = {u.key: u.used for u in client.usage()}
            assert held["global:jobs:concurrency"] == 1
            assert {u.key: u.used for u in client.usage()}["global:jobs:concurrency"] == 0
        scrape = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'shoal_quota_reserves_total{result="allowed"} 1.0' in scrape
        rpm = 'key="global:llm:openai:gpt-4o:rpm",kind="rate"'
        assert f"shoal_quota_limit_used{{{rpm}}} 1.0" in scrape
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert (tmp_path / "data" / "quota.db").exists()


def test_a_bad_limits_file_is_a_message_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "limits.toml"
    config.write_text('[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 1\n')
    assert main(["quota", "serve", "--config", str(config)]) == 2
    assert "a rate limit needs window_s" in capsys.readouterr().err
    assert main(["quota", "serve", "--config", str(tmp_path / "missing.toml")]) == 2


def test_a_backend_it_cannot_open_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "limits.toml"
    config.write_text(ISSUE_EXAMPLE)
    args = ["quota", "serve", "--config", str(config), "--backend"]
    missing = f"sqlite:///{tmp_path}/missing/dir/q.db"
    nobody = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    for url, says in ((missing, "unable to open database file"), (nobody, "Connection refused")):
        assert main([*args, url]) == 2
        err = capsys.readouterr().err
        assert err.startswith("shoal quota serve: cannot ") and says in err, err
        assert err.count("\n") == 1 and "secret" not in err
    done = subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args, missing], capture_output=True, text=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
