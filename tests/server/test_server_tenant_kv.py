"""Tenants' KV and budgets (`--keys`): the same long prompt sent by tenant B after tenant A
reports 0 cached tokens and by A again reports them (chat, Messages, Responses), also after a
restart (from the disk tier); a request's `cache_salt` narrows A's own reuse; a declared
shared prefix is reused across tenants, and nothing past it; a tenant over its quota gets 429
while the other is served; SIGHUP rotates keys, a bad keys file stops nothing but the reload,
and a server given one does not start (one line)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_fixtures import HERE
from server_harness import LiveServer, SpawnedServer
from tenant_helpers import (
    ALPHA,
    BETA,
    GAMMA,
    LONG,
    SHARED_SYSTEM,
    cached_chat,
    claude,
    keys_file,
    oai,
)

from shoal.cli import main as shoal_main
from shoal.server.keys import hash_key


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("tenant-kv"))


@pytest.fixture(scope="module")
def live(start_server: Callable[..., LiveServer], folder: Path) -> LiveServer:
    (folder / "limits.toml").write_text("[serve]\nrpm = 1000\n")
    return start_server(
        keys_file=keys_file(folder),
        quota_config=folder / "limits.toml",
        data_dir=folder / "data",
    )


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_a_prompt_is_cached_for_its_own_tenant_only(live: LiveServer) -> None:
    alpha, beta = oai(live, ALPHA), oai(live, BETA)
    chat = user("Chat. " + LONG)
    assert cached_chat(alpha, live.model, chat) == 0
    assert cached_chat(beta, live.model, chat) == 0
    assert cached_chat(alpha, live.model, chat) > 0
    assert cached_chat(alpha, live.model, chat, extra_body={"cache_salt": "s"}) == 0
    assert cached_chat(alpha, live.model, chat, extra_body={"cache_salt": "s"}) > 0

    def read(key: str) -> int:
        m = claude(live, key).messages.create(
            model=live.model, max_tokens=2, messages=user("Messages. " + LONG)
        )
        return int(m.usage.cache_read_input_tokens or 0)

    assert (read(ALPHA), read(BETA), read(ALPHA) > 0) == (0, 0, True)

    def response(key: str) -> int:
        r = oai(live, key).responses.create(
            model=live.model, input="Responses. " + LONG, max_output_tokens=2
        )
        assert r.usage is not None
        return r.usage.input_tokens_details.cached_tokens

    assert (response(ALPHA), response(BETA), response(ALPHA) > 0) == (0, 0, True)


def test_only_the_declared_shared_prefix_is_reused_across_tenants(live: LiveServer) -> None:
    alpha, beta = oai(live, ALPHA), oai(live, BETA)
    system = {"role": "system", "content": SHARED_SYSTEM}
    chat = [system, *user("Shared prefix. " + LONG)]
    assert cached_chat(alpha, live.model, chat) == 0
    shared = cached_chat(beta, live.model, chat)
    whole = cached_chat(alpha, live.model, chat)
    assert 0 < shared < whole  # beta got the declared system prompt's blocks, and no more
    other = [{"role": "system", "content": "Unshared. " + SHARED_SYSTEM}, *user("x")]
    cached_chat(alpha, live.model, other)
    assert cached_chat(beta, live.model, other) == 0


def test_a_tenant_over_its_quota_is_refused_while_the_other_is_served(live: LiveServer) -> None:
    gamma, beta = oai(live, GAMMA), oai(live, BETA)
    body: dict[str, Any] = {"model": live.model, "prompt": "Hi", "max_tokens": 1}
    assert gamma.completions.create(**body).choices  # gamma's budget: 1 request a minute
    with pytest.raises(openai.RateLimitError) as e:
        gamma.completions.create(**body)
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
    for _ in range(3):
        assert beta.completions.create(**body).choices
    with pytest.raises(anthropic.RateLimitError):  # whichever API gamma asks through
        claude(live, GAMMA).messages.create(model=live.model, max_tokens=1, messages=user("x"))


def test_tenants_stay_apart_after_a_restart(
    live: LiveServer, start_server: Callable[..., LiveServer], folder: Path
) -> None:
    """A clean stop writes the cached blocks to disk; the next server finds each tenant's
    there, for that tenant only."""
    chat = user("Before the restart. " + LONG)
    assert cached_chat(oai(live, BETA), live.model, chat) == 0
    live.stop()  # (the module's last use of `live`)
    again = start_server(keys_file=folder / "keys.toml", data_dir=folder / "data")
    assert cached_chat(oai(again, ALPHA), again.model, chat) == 0
    assert cached_chat(oai(again, BETA), again.model, chat) > 0
    again.stop()


@pytest.fixture
def spawn_keyed(
    tiny_chat_model: Path, spawn_command: Callable[..., SpawnedServer], tmp_path: Path
) -> Callable[[Path], SpawnedServer]:
    def spawn(keys: Path) -> SpawnedServer:
        return spawn_command(
            lambda port: [
                *(sys.executable, str(HERE / "serve_tiny.py"), "--model", str(tiny_chat_model)),
                *("--port", str(port), "--data-dir", str(tmp_path / "data")),
                *("--keys", str(keys)),
            ]
        )

    return spawn


def test_sighup_rotates_keys_and_a_bad_file_keeps_the_old_ones(
    spawn_keyed: Callable[[Path], SpawnedServer], tmp_path: Path
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[key]]\nsha256 = "{hash_key("old")}"\ntenant = "alpha"\n')
    srv = spawn_keyed(path)

    def status(key: str) -> int:
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        return r.status_code

    assert (status("old"), status("new")) == (200, 401)
    path.write_text("this is = not [toml")
    srv.proc.send_signal(signal.SIGHUP)
    assert status("old") == 200  # (a reload that fails is logged; nothing changes)
    path.write_text(f'[[key]]\nsha256 = "{hash_key("new")}"\ntenant = "alpha"\n')
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while status("new") != 200:
        assert time.monotonic() < deadline, "the keys were not reloaded"
        time.sleep(0.05)
    assert status("old") == 401
    assert "keys not reloaded" in srv.log.read_text()


def test_a_keys_file_that_does_not_parse_stops_the_server_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "keys.toml"
    bad.write_text('[[key]]\nsha256 = "abc"\ntenant = "alpha"\n')
    assert shoal_main(["serve", "--keys", str(bad), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sha256 must be 64 hex digits" in err
