"""`shoal serve --replicas N` and `shoal cluster deploy`: their arguments and what they run.

Imports no Ray until a command runs, so `shoal` starts (and `shoal serve` serves) without it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.cluster.app import ClusterConfig
    from shoal.server.state import ServerConfig

ServerConfigOf = Callable[[argparse.Namespace], "ServerConfig | None"]


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install 'shoal[cluster]')")
    g.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        default=0,
        help="engine replicas behind a Ray Serve ingress; 0: one engine in this process, no Ray",
    )
    g.add_argument(
        "--replica-cpus", type=float, metavar="N", default=1.0, help="Ray CPUs per replica"
    )
    g.add_argument(
        "--replica-gpus", type=float, metavar="N", default=0.0, help="Ray GPUs per replica"
    )
    g.add_argument(
        "--imbalance-threshold",
        type=int,
        metavar="N",
        default=8,
        help="requests a session's home may queue beyond the lightest replica before its "
        "turn goes to the lightest",
    )


def cluster_config(args: argparse.Namespace, server: ServerConfig) -> ClusterConfig:
    from shoal.cluster.app import ClusterConfig

    if server.engine.cache_dir:
        raise SystemExit(
            "shoal: --cache-dir is per replica with --replicas (each keeps its sessions under "
            "its own data dir); replicas share session KV through --session-tier"
        )
    return ClusterConfig(
        server=server,
        replicas=max(1, args.replicas),
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        session_tier=Path(tier) if (tier := server.engine.session_tier_dir) else None,
        imbalance_threshold=args.imbalance_threshold,
    )


def serve_replicas(args: argparse.Namespace, server: ServerConfig) -> int:
    """`shoal serve --replicas N`: a local Ray with the application, until SIGINT/SIGTERM."""
    try:
        from shoal.cluster.app import serve_until_signalled
    except ImportError as e:
        print(f"shoal serve --replicas needs pip install 'shoal[cluster]' ({e})", file=sys.stderr)
        return 2
    serve_until_signalled(cluster_config(args, server), args.host, args.port)
    return 0


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    server_arguments: Callable[[argparse.ArgumentParser], None],
    server_config: ServerConfigOf,
) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="shoal on Ray (pip install 'shoal[cluster]')",
        description="Engine replicas behind one OpenAI + Anthropic ingress on Ray Serve, each "
        "session's turns routed to the replica holding its KV.",
    )
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    deploy = commands.add_parser(
        "deploy",
        help="deploy the ingress and engine replicas on a running Ray cluster",
        description="Deploy shoal as a Ray Serve application on a running Ray cluster; it takes "
        "`shoal serve`'s flags.",
        epilog="examples:\n"
        "  shoal cluster deploy --address auto --replicas 4 --replica-gpus 1 \\\n"
        "      --session-tier /mnt/shared/shoal-tier --store postgresql://shoal@db/shoal",
    )
    deploy.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster: auto (this machine's) or ray://host:10001",
    )
    server_arguments(deploy)
    add_replica_arguments(deploy)
    deploy.set_defaults(func=lambda args: _deploy(args, server_config), replicas=2)


def _deploy(args: argparse.Namespace, server_config: ServerConfigOf) -> int:
    server = server_config(args)
    if server is None:
        return 2
    config = cluster_config(args, server)
    try:
        import ray
        from ray import serve

        from shoal.cluster.app import deploy
    except ImportError as e:
        print(f"shoal cluster needs pip install 'shoal[cluster]' ({e})", file=sys.stderr)
        return 2
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    deploy(config)
    print(f"shoal cluster: application {config.app_name!r} deployed, {config.replicas} replicas")
    return 0
