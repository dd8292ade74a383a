"""Servers in subprocesses on 127.0.0.1 for the benchmarks that measure over HTTP: `shoal
serve`, and the port and stop every peer's server needs too."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(data_dir: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """`shoal serve` with its own `data_dir` (and `args`), once its `/health` answers: the
    process and its base URL. Output is discarded; a server that does not come up in 5 min
    is killed."""
    port = free_port()
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(port)]
    cmd += ["--data-dir", data_dir, "--max-waiting", "100000", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def stop(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Terminate a server and wait for it; kill it if it has not gone in `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
