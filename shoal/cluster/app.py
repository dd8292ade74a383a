"""The Ray Serve application: an `Ingress` deployment in front of N `EngineReplica`s, and the two
ways to start it: on a local Ray started here (`shoal serve --replicas N`), or on an existing
cluster (`shoal cluster deploy --address ...`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.schema import ProxyStatus

from shoal.cluster.ingress import Ingress
from shoal.cluster.replica import EngineReplica
from shoal.cluster.router import SessionAffinityRouter as ROUTER
from shoal.server.state import ServerConfig

MiB = 1 << 20
# Ray Serve waits a fixed 60 s for its HTTP proxy (`HTTP_PROXY_TIMEOUT`, not configurable) and
# raises; on a busy machine the proxy may still be importing. shoal waits this much longer.
PROXY_PATIENCE_S = 600.0

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClusterConfig:
    """How many engine replicas, what each may use, and how requests find them.

    Every replica runs `server` (its engine, limits, auth, batch settings) with its own data
    dir under `server.data_dir`; `session_tier` (default `<data dir>/session-tier`) must be
    one folder every replica sees, on shared storage when replicas span machines. `tier=False`
    shares no session KV: each replica keeps its sessions to itself, as plain `shoal serve`
    processes would (the generic baseline of benchmarks/cluster_sessions.py).
    """

    server: ServerConfig
    replicas: int = 2
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ingress_cpus: float = 0.1
    session_tier: Path | None = None
    tier: bool = True
    imbalance_threshold: int = 8  # queue length over the lightest replica's before a move
    policy: str = "affine"  # or "round_robin": the baseline of benchmarks/cluster_sessions.py
    max_ongoing_requests: int = 0  # per replica; 0: the engine's max_waiting + max_num_seqs
    app_name: str = "shoal"

    def replica_server(self) -> ServerConfig:
        tier = self.session_tier or self.server.data_dir / "session-tier"
        engine = dataclasses.replace(
            self.server.engine, session_tier_dir=str(tier) if self.tier else None, cache_dir=None
        )
        return dataclasses.replace(self.server, engine=engine)


def build_application(config: ClusterConfig) -> Any:
    """The bound application `serve.run` deploys."""
    server = config.replica_server()
    engine = server.engine
    replica = serve.deployment(
        name="engine",
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
        max_ongoing_requests=config.max_ongoing_requests
        or engine.max_waiting + engine.max_num_seqs,
        request_router_config={
            "request_router_class": f"{ROUTER.__module__}:{ROUTER.__qualname__}",
            "request_router_kwargs": {
                "imbalance_threshold": config.imbalance_threshold,
                "policy": config.policy,
            },
        },
        graceful_shutdown_timeout_s=server.drain_timeout_s + server.batch_grace_s + 5,
    )(EngineReplica)
    ingress = serve.deployment(
        name="ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": config.ingress_cpus},
        max_ongoing_requests=100_000,
    )(Ingress)
    # Every replica is given the same `--store` (else each keeps SQLite in its own data dir).
    shared_store = server.store is not None
    return ingress.bind(
        replica.bind(server),
        server.max_upload_bytes,
        shared_store,
        api_key=server.api_key,
        keys_file=str(server.keys_file) if server.keys_file else None,
        metrics_key=server.metrics_key,
    )


def start_local(
    config: ClusterConfig, host: str = "127.0.0.1", port: int = 8000, num_cpus: int | None = None
) -> None:
    """Start a Ray instance on this machine (no dashboard, a small object store) and deploy.
    The HTTP proxy listens on `host`; Ray's own processes talk over this machine's address.

    Ray's CPUs are a logical count: at least what the deployments ask for (the ingress's too),
    else replicas of one CPU each on a machine of as many cores would leave the ingress waiting.
    """
    wanted = math.ceil(config.replicas * config.replica_cpus + config.ingress_cpus)
    ray.init(
        address="local",
        num_cpus=max(num_cpus or os.cpu_count() or 1, wanted),
        include_dashboard=False,
        object_store_memory=256 * MiB,
        log_to_driver=False,
        configure_logging=False,
    )
    http = {"host": host, "port": port}
    proxy_may_be_late(
        lambda: serve.start(http_options=http, logging_config={"enable_access_log": False})
    )
    proxy_may_be_late(lambda: deploy(config))


def proxy_may_be_late(step: Callable[[], object], patience_s: float = PROXY_PATIENCE_S) -> None:
    """Run a Serve step that ends by waiting for the HTTP proxy; if Ray gives up on a proxy
    that is only slow, go on waiting for it (a repeated step would redeploy every replica)."""
    try:
        step()
    except TimeoutError as late:
        log.warning("Ray Serve's HTTP proxy is late (%s); waiting up to %.0f s", late, patience_s)
        wait_for_proxies(patience_s)


def wait_for_proxies(patience_s: float) -> None:
    """Return once every Serve HTTP proxy reports healthy; TimeoutError after `patience_s`."""
    deadline = time.monotonic() + patience_s
    while True:
        proxies = serve.status().proxies
        if proxies and all(p == ProxyStatus.HEALTHY for p in proxies.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Ray Serve's HTTP proxies not healthy after {patience_s:.0f} s: {proxies}"
            )
        time.sleep(0.5)


def deploy(config: ClusterConfig) -> None:
    """Deploy (or update) the application on the Ray cluster this process is connected to;
    returns once every replica is up."""
    serve.run(build_application(config), name=config.app_name, route_prefix="/", blocking=False)


def stop_local() -> None:
    serve.shutdown()
    ray.shutdown()


def serve_until_signalled(config: ClusterConfig, host: str, port: int) -> None:
    """`shoal serve --replicas N`: start locally, answer until SIGINT/SIGTERM, shut down."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    start_local(config, host, port)
    try:
        print(f"shoal cluster: {config.replicas} replicas at http://{host}:{port}", flush=True)
        stop.wait()
    finally:
        stop_local()
