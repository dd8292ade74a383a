"""The limits file: the issue's format works as written; mistakes are named, not guessed at."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from quota_helpers import ISSUE_EXAMPLE

from shoal.quota import LimitKind, QuotaInvalidError, QuotaService, load_config
from shoal.quota.limits import parse_config
from shoal.quota.testing import LocalRedis


def test_the_issue_example_loads_as_written(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    path.write_text(ISSUE_EXAMPLE)
    config = load_config(path)
    rpm, jobs = config.limits
    assert (rpm.key, rpm.kind, rpm.capacity, rpm.window_s) == (
        "global:llm:openai:gpt-4o:rpm",
        LimitKind.RATE,
        100,
        60.0,
    )
    # A concurrency limit without a window: its holds live as long as a lease.
    assert (jobs.kind, jobs.capacity, jobs.window_s) == (LimitKind.CONCURRENCY, 8, 300.0)
    assert config.max_batch == 256 and config.backend is None


def test_top_level_settings(tmp_path: Path) -> None:
    text = 'lease_ttl_s = 90\nmax_batch = 64\nbackend = "redis://127.0.0.1:1/0"\n'
    config = parse_config(tomllib.loads(text + ISSUE_EXAMPLE))
    assert config.policy.ttl_s == 90 and config.max_batch == 64
    assert config.backend == "redis://127.0.0.1:1/0"
    assert config.limits[1].window_s == 90  # the concurrency default follows the lease TTL


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 1\n', "needs window_s"),
        ('[[limit]]\nkey = "a"\nkind = "bucket"\ncapacity = 1\n', "kind must be"),
        ('[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 0\nwindow_s = 1\n', "capacity"),
        ('[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 1.5\nwindow_s = 1\n', "capacity"),
        ('[[limit]]\nkey = "a b"\nkind = "rate"\ncapacity = 1\nwindow_s = 1\n', "key"),
        ('[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 1\nwindow_s = -1\n', "window_s"),
        ('[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 1\nwindow = 1\n', "unknown field"),
        ("limits = []\n", "unknown field"),
        (
            '[[limit]]\nkey = "a"\nkind = "rate"\ncapacity = 1\nwindow_s = 1\n' * 2,
            "declared twice",
        ),
        ("[[limit]\n", "limits.toml"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "limits.toml"
    path.write_text(text)
    with pytest.raises(QuotaInvalidError, match=message):
        load_config(path)


def test_service_open_declares_the_file_limits_in_sqlite_under_the_data_dir(
    tmp_path: Path,
) -> None:
    config = parse_config(tomllib.loads(ISSUE_EXAMPLE))
    service = QuotaService.open(config, data_dir=tmp_path / "data")
    try:
        assert service.backend.name == "sqlite"
        assert (tmp_path / "data" / "quota.db").exists()
        assert [lim.key for lim in service.limits()] == [
            "global:jobs:concurrency",
            "global:llm:openai:gpt-4o:rpm",
        ]
    finally:
        service.close()


def test_unknown_backend_url_is_refused(tmp_path: Path) -> None:
    config = parse_config({})
    with pytest.raises(QuotaInvalidError, match="unknown backend"):
        QuotaService.open(config, backend_url="postgres://x", data_dir=tmp_path)


def test_a_redis_url_opens_the_redis_backend(tmp_path: Path, redis_server: LocalRedis) -> None:
    config = parse_config(tomllib.loads(ISSUE_EXAMPLE))
    service = QuotaService.open(config, backend_url=redis_server.url, data_dir=tmp_path)
    try:
        assert service.backend.name == "redis"
        assert len(service.limits()) >= 2
        assert not (tmp_path / "quota.db").exists()
    finally:
        service.close()
