"""Starting the cluster survives a slow HTTP proxy: Ray Serve gives up on it after a fixed 60 s,
shoal goes on waiting until the proxy is healthy, and still fails when it never is."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from cluster_harness import Cluster
from ray.serve.schema import ProxyStatus

from shoal.cluster import app


def late_step() -> None:
    raise TimeoutError("HTTP proxies not available after 60s.")


def test_a_late_proxy_is_waited_for_until_it_is_healthy(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=app.__name__):
        app.proxy_may_be_late(late_step, patience_s=60)  # the cluster's proxy is healthy
    assert "proxy is late" in caplog.text


def test_a_proxy_that_never_becomes_healthy_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def starting() -> SimpleNamespace:
        seen.append(1)
        return SimpleNamespace(proxies={"node": ProxyStatus.STARTING})

    monkeypatch.setattr(app.serve, "status", starting)
    with pytest.raises(TimeoutError, match="not healthy"):
        app.proxy_may_be_late(late_step, patience_s=0.6)
    assert len(seen) >= 2  # it polled, rather than giving up at once


def test_a_step_that_fails_otherwise_is_not_retried() -> None:
    def broken() -> None:
        raise ValueError("bad application")

    with pytest.raises(ValueError, match="bad application"):
        app.proxy_may_be_late(broken, patience_s=60)
