"""`--replicas` and the serve flags become one `ClusterConfig`: every replica gets the server's
settings, its own data dir and session cache, and the one shared tier."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shoal.cluster.cli import add_replica_arguments, cluster_config
from shoal.config import EngineConfig
from shoal.server.state import ServerConfig


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_replica_arguments(p)
    return p.parse_args(list(argv))


def test_replica_flags_and_the_tier_reach_every_replica(tmp_path: Path) -> None:
    engine = EngineConfig(model="m", session_tier_dir=str(tmp_path / "tier"))
    server = ServerConfig(engine=engine, data_dir=tmp_path / "data", api_key="k")
    config = cluster_config(args("--replicas", "3", "--replica-gpus", "1"), server)
    assert (config.replicas, config.replica_gpus, config.replica_cpus) == (3, 1.0, 1.0)
    replica = config.replica_server()
    assert replica.engine.session_tier_dir == str(tmp_path / "tier")
    assert replica.api_key == "k" and replica.engine.model == "m"
    default = cluster_config(args("--replicas", "2"), ServerConfig(data_dir=tmp_path / "d"))
    assert default.replica_server().engine.session_tier_dir == str(tmp_path / "d" / "session-tier")


def test_a_shared_cache_dir_is_refused(tmp_path: Path) -> None:
    server = ServerConfig(engine=EngineConfig(cache_dir=str(tmp_path)))
    with pytest.raises(SystemExit, match="--session-tier"):
        cluster_config(args("--replicas", "2"), server)
