"""What a hostile or careless client must not be able to do to a server, and what an operator
relies on: no request stalls the event loop, every `shoal serve` flag reaches the engine, one
server per data dir, sessions survive restarts, uploads stream to disk, OpenAI-shaped 400s."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from server_harness import LiveServer, SpawnedServer

USER_TURNS = ["Say hello.", "Now count to three.", "And tell a story."]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def info_labels(url: str, name: str) -> dict[str, str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{name}_info\{{(.*)\}} 1.0$", text, re.M)
    assert found, name
    return dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))


# -- the event loop stays free -------------------------------------------------------------
def test_huge_prompt_is_a_fast_400_and_never_stalls_health(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    srv = spawn_server(tmp_path / "data")  # its own process: the client's work is not its own
    content = "word " * 1_200_000  # ~6 MB, under the 8 MiB body limit
    messages = [{"role": "user", "content": content}]
    body = json.dumps({"model": model_of(srv.url), "messages": messages}).encode()

    def worst_health_latency() -> tuple[float, float]:
        """Send the big request; poll /health until it is answered: the slowest poll, and
        how long the big request took."""
        result: dict[str, httpx.Response] = {}

        def send() -> None:
            result["r"] = httpx.post(
                f"{srv.url}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=60,
            )

        sender = threading.Thread(target=send)
        began = time.perf_counter()
        sender.start()
        worst = 0.0
        with httpx.Client() as health:
            while sender.is_alive():
                t = time.perf_counter()
                assert health.get(f"{srv.url}/health", timeout=10).status_code == 200
                worst = max(worst, time.perf_counter() - t)
        sender.join()
        took = time.perf_counter() - began
        r = result["r"]
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        return worst, took

    # Best of three: a busy machine alone can delay one poll; a blocked loop delays all. A
    # loop blocked by the big request holds a poll for a good part of the request's time,
    # so the bound grows with it on a slower (or busier) machine.
    worst, took = min(worst_health_latency() for _ in range(3))
    bound = max(0.1, took / 10)
    assert worst < bound, f"/health took {worst:.3f} s while the {took:.3f} s request ran"


# -- every flag reaches the engine ---------------------------------------------------------
FLAGS = {
    "--dtype": ("float64", ("shoal_engine", "dtype", "float64")),
    "--block-size": ("8", ("shoal_engine", "block_size", "8")),
    "--max-num-seqs": ("3", ("shoal_engine", "max_num_seqs", "3")),
    "--max-num-batched-tokens": ("96", ("shoal_engine", "max_num_batched_tokens", "96")),
    "--max-model-len": ("200", ("shoal_engine", "max_model_len", "200")),
    "--kv-cache-gib": ("0.0001", ("shoal_engine", "num_blocks", None)),
    "--no-prefix-caching": (None, ("shoal_engine", "prefix_caching", "false")),
    "--max-waiting": ("7", ("shoal_engine", "max_waiting", "7")),
    "--batch-concurrency": ("2", ("shoal_server", "batch_concurrency", "2")),
    "--backend": ("torch", ("shoal_engine", "backend", "torch")),
}


@pytest.fixture
def cli_server(
    spawn_command: Callable[..., SpawnedServer], tiny_chat_model: Path, tmp_path: Path
) -> SpawnedServer:
    argv = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(tiny_chat_model)]
    argv += ["--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "kv")]
    for flag, (value, _) in FLAGS.items():
        argv += [flag] if value is None else [flag, value]
    return spawn_command(lambda port: [*argv, "--host", "127.0.0.1", "--port", str(port)])


def test_every_serve_flag_reaches_the_engine(cli_server: SpawnedServer, tmp_path: Path) -> None:
    url = cli_server.url
    for flag, (_, (info, label, want)) in FLAGS.items():
        got = info_labels(url, info)[label]
        if flag == "--kv-cache-gib":  # 0.0001 GiB of float64 KV for the tiny model
            per_block = 8 * 2 * 2 * 2 * 16 * 8  # tokens x layers x (k, v) x heads x dim x bytes
            assert int(got) == int(0.0001 * (1 << 30)) // per_block, flag
            assert metric(url, "shoal_kv_cache_blocks_free") == int(got), flag
        else:
            assert got == want, flag
    labels = info_labels(url, "shoal_engine")
    assert labels["session_cache_dir"] == str(tmp_path / "kv")
    assert info_labels(url, "shoal_server")["data_dir"] == str(tmp_path / "data")
    model = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert model["max_model_len"] == 200


# -- one server per data dir ---------------------------------------------------------------
def test_second_server_on_a_data_dir_exits_at_once(
    spawn_server: Callable[..., SpawnedServer], tiny_chat_model: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    first = spawn_server(data)
    argv = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(tiny_chat_model)]
    argv += ["--data-dir", str(data), "--port", "1"]  # it must stop before binding anything
    t = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "in use" in done.stderr and str(data) in done.stderr
    assert time.monotonic() - t < 30  # no model load: it stops at the lock
    assert httpx.get(f"{first.url}/health").status_code == 200  # the first one is untouched


# -- sessions survive restarts ---------------------------------------------------------------
def chat_turn(url: str, model: str, history: list[dict[str, str]], sid: str | None) -> dict:
    headers = {"X-Session-Id": sid} if sid else {}
    body = {"model": model, "messages": history, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def model_of(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])


def play(url: str, turns: list[str], history: list[dict[str, str]], sid: str | None) -> dict:
    reply: dict = {}
    for text in turns:
        history.append({"role": "user", "content": text})
        reply = chat_turn(url, model_of(url), history, sid)
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return reply


@pytest.mark.parametrize("how", ["graceful", "kill -9"])
def test_session_survives_a_server_restart(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path, how: str
) -> None:
    fresh = spawn_server(tmp_path / "fresh")  # the reference: no session, nothing cached
    reference = play(fresh.url, USER_TURNS, [], None)["choices"][0]["message"]["content"]
    fresh.terminate()

    data = tmp_path / "data"
    srv = spawn_server(data)
    history: list[dict[str, str]] = []
    play(srv.url, USER_TURNS[:2], history, "agent-1")
    if how == "graceful":  # uvicorn re-raises SIGTERM once it has shut down cleanly
        assert srv.terminate() in (0, -15) and "Traceback" not in srv.log.read_text()
    else:  # an idle server writes the session within about a second; then pull the plug
        deadline = time.monotonic() + 30
        while metric(srv.url, "shoal_disk_writes_total") < 1:
            assert time.monotonic() < deadline, "the idle server never saved the session"
            time.sleep(0.1)
        srv.kill()
    srv2 = spawn_server(data)
    reply = play(srv2.url, USER_TURNS[2:], history, "agent-1")
    assert reply["choices"][0]["message"]["content"] == reference
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric(srv2.url, "shoal_disk_reads_total") == 1
    assert metric(srv2.url, "shoal_session_hits_total") == 1


# -- files stream ----------------------------------------------------------------------------
def peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    assert found
    return int(found.group(1))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_upload_and_download_stream_through_bounded_memory(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    srv = spawn_server(tmp_path / "data")
    prompt = "x" * 4000
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m", "prompt": prompt, "max_tokens": 1},
            }
        )
        for i in range(10_000)
    ]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")  # ~40 MB
    size = path.stat().st_size
    small = tmp_path / "small.jsonl"
    small.write_text(lines[0] + "\n")
    client = srv.client()
    client.files.create(file=small.open("rb"), purpose="batch")  # warm the upload path up
    before = peak_rss_kib(srv.proc.pid)
    obj = client.files.create(file=path.open("rb"), purpose="batch")
    assert obj.bytes == size
    with httpx.stream("GET", f"{srv.url}/v1/files/{obj.id}/content", timeout=60) as r:
        got = sum(len(chunk) for chunk in r.iter_bytes())
    assert got == size
    grown_mib = (peak_rss_kib(srv.proc.pid) - before) / 1024
    assert grown_mib < 24, f"peak memory grew {grown_mib:.0f} MiB for a {size >> 20} MiB file"


# -- OpenAI-shaped errors --------------------------------------------------------------------
def test_query_errors_are_400_and_params_name_fields(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/v1/batches", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None


def test_session_id_length_is_one_rule_for_body_and_header(server: LiveServer) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    long = "s" * 257
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "session_id": long})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Session-Id": long})
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Session-Id": "s" * 256})
    assert ok.status_code == 200
    # the server is shared: give the session's blocks back for the tests that check the pool
    assert asyncio.run(server.state.serving.aeng.drop_session("s" * 256))
