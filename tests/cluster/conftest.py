"""One local Ray cluster for every cluster test: an ingress and 2 engine replicas of the tiny
chat model on 127.0.0.1, sharing a session tier and a batch store (a database in the session's
throwaway PostgreSQL, with a 2 s lease), each with its own data dir, and a keys file (`unused`,
the key the SDK clients of most tests send, is the `default` tenant's; `cluster_harness.KEYS`
names two more tenants); stopped when the cluster tests are done.

On 2 cores: replicas at half a CPU each, no dashboard, a small object store, every wait bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_harness import APP, KEYS, PATIENCE_S, Cluster
from server_harness import free_port

from shoal.cluster.app import ClusterConfig, start_local, stop_local
from shoal.config import EngineConfig
from shoal.server.keys import hash_key
from shoal.server.state import ServerConfig

BATCH_LEASE_S = 2.0
BATCH_CONCURRENCY = 2  # batch requests per replica at once


@pytest.fixture(scope="package")
def cluster(
    tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory, postgres: Any
) -> Iterator[Cluster]:
    data = tmp_path_factory.mktemp("cluster")
    keys = data / "keys.toml"
    entries = [("unused", "default"), *KEYS.items()]
    keys.write_text(
        "".join(f'[[key]]\nsha256 = "{hash_key(k)}"\ntenant = "{t}"\n' for k, t in entries)
    )
    engine = EngineConfig(model=str(tiny_chat_model), num_blocks=512, max_waiting=256)
    server = ServerConfig(
        engine=engine,
        data_dir=data,
        drain_timeout_s=2.0,
        batch_grace_s=0.5,
        store=postgres.new_database(),
        batch_lease_s=BATCH_LEASE_S,
        batch_concurrency=BATCH_CONCURRENCY,
        batch_gate=data / "gate",
        keys_file=keys,
    )
    config = ClusterConfig(
        server,
        replicas=2,
        replica_cpus=0.5,
        app_name=APP,
    )
    port = free_port()
    started = time.monotonic()
    start_local(config, "127.0.0.1", port, num_cpus=2)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PATIENCE_S
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the cluster did not become ready"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer unused"}
        model = httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
        print(f"cluster ready in {time.monotonic() - started:.1f} s")
        yield Cluster(url, model, tiny_chat_model, data / "session-tier", data / "gate")
    finally:
        stop_local()
