"""`shoal serve`: the OpenAI- and Anthropic-compatible server, its flags and the `ServerConfig`
they describe (also `shoal cluster deploy`'s)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.cli.engine_args import engine_arguments, engine_config
from shoal.cli.formatting import examples
from shoal.cluster.cli import add_replica_arguments
from shoal.errors import ShoalError

if TYPE_CHECKING:
    from shoal.server.state import ServerConfig

SERVE_EXAMPLES = examples(
    "shoal serve                                  # the bundled SmolLM2-135M on 127.0.0.1:8000",
    "shoal serve --model ./Qwen2.5-1.5B-Instruct --dtype bfloat16 --api-key secret",
    "shoal serve --cache-dir ./kv                 # sessions and the disk tier survive restarts",
    "shoal serve --store postgresql://shoal@db/shoal   # batches shared by several servers",
    "shoal serve --keys keys.toml --metrics-key scrape # one tenant per key (docs/tenancy.md)",
    "shoal serve --replicas 2 --replica-cpus 1    # two engines behind Ray Serve",
)


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="the OpenAI- and Anthropic-compatible HTTP server",
        description="Serve a model over the OpenAI API (chat, completions, Responses, Files + "
        "Batches) and the Anthropic API (Messages, Message Batches), with /metrics for "
        "Prometheus.",
        epilog=SERVE_EXAMPLES,
    )
    server_arguments(serve)
    add_replica_arguments(serve)
    serve.set_defaults(func=_serve)


def server_arguments(serve: argparse.ArgumentParser) -> None:
    engine_arguments(serve)
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="address to listen on")
    http.add_argument("--port", type=int, default=8000, metavar="N", help="port to listen on")
    http.add_argument(
        "--api-key", default=None, metavar="KEY", help="require this key (Bearer or x-api-key)"
    )
    http.add_argument(
        "--keys",
        default=None,
        metavar="TOML",
        help="hashed API keys, each a tenant's: its stored objects, sessions, KV and quota are "
        "its own (docs/tenancy.md); SIGHUP reloads the file",
    )
    http.add_argument(
        "--metrics-key", default=None, metavar="KEY", help="/metrics asks for this key"
    )
    http.add_argument(
        "--max-waiting", type=int, default=1024, metavar="N", help="queued requests before a 429"
    )
    http.add_argument(
        "--quota",
        default=None,
        metavar="TOML",
        help="a limits file with a [serve] rpm/tpm budget per tenant (--keys) or API key",
    )
    http.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's per-request x-anthropic-billing-header system line (by default "
        "it is removed before tokenising, since it defeats every prefix cache)",
    )
    state = serve.add_argument_group("stored state: files, batches, responses")
    state.add_argument(
        "--data-dir",
        default="./shoal-data",
        metavar="DIR",
        help="files, batches, responses, sessions",
    )
    state.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="files and batches: a path, sqlite:///path.db or postgresql://user@host/db, "
        "shared by every server given the same one (default: SQLite in --data-dir)",
    )
    state.add_argument(
        "--batch-concurrency",
        type=int,
        metavar="N",
        default=0,
        help="batch requests in flight (0: twice --max-num-seqs)",
    )
    state.add_argument(
        "--batch-lease-s",
        type=float,
        metavar="S",
        default=10.0,
        help="a dead server's batch lines go to the others after this many seconds",
    )
    state.add_argument(
        "--responses-keep",
        type=int,
        metavar="N",
        default=100_000,
        help="stored /v1/responses objects kept at most (the oldest go first)",
    )
    state.add_argument(
        "--responses-max-age-days",
        type=float,
        metavar="DAYS",
        default=30.0,
        help="stored /v1/responses objects are dropped after this many days",
    )
    state.add_argument(
        "--session-tier",
        default=None,
        metavar="DIR",
        help="a folder each finished turn's session KV is written behind to; servers sharing "
        "it restore each other's sessions (and a restart, the turns a kill -9 cut off)",
    )
    _schema_limit_arguments(serve)


def _schema_limit_arguments(serve: argparse.ArgumentParser) -> None:
    from shoal.server.schema_check import SchemaLimits

    limits = serve.add_argument_group(
        "JSON schema limits (OpenAI's for strict structured outputs; past them, a 400)"
    )
    for name, what in [
        ("properties", "object properties in all"),
        ("depth", "levels of nesting"),
        ("enum_values", "enum values in all"),
        ("chars", "characters of property and definition names, enum and const values"),
        ("large_enum_chars", "characters of one string enum of more than 250 values"),
    ]:
        flag = "--max-schema-" + name.replace("_", "-")
        limits.add_argument(
            flag, type=int, metavar="N", default=getattr(SchemaLimits(), name), help=what
        )


def server_config(args: argparse.Namespace) -> ServerConfig | None:
    """The `ServerConfig` the server flags describe; None (after a message) if they are bad."""
    from shoal.server.schema_check import SchemaLimits
    from shoal.server.state import ServerConfig

    if args.quota:  # a bad limits file is a message, before the model loads
        from shoal.server.quota import read_config

        try:
            read_config(args.quota)
        except (OSError, ShoalError) as e:
            print(f"shoal serve: --quota: {e}", file=sys.stderr)
            return None
    if args.keys:  # a keys file that cannot be used: one line, before the model loads
        from shoal.server.keys import read_keys

        try:
            read_keys(args.keys)
        except ShoalError as e:
            print(f"shoal serve: {e}", file=sys.stderr)
            return None
    if args.batch_lease_s <= 0:
        print("shoal serve: --batch-lease-s must be positive", file=sys.stderr)
        return None
    if args.responses_keep < 1 or args.responses_max_age_days <= 0:
        print("shoal serve: --responses-keep and --responses-max-age-days must be positive",
              file=sys.stderr)  # fmt: skip
        return None
    return ServerConfig(
        engine=engine_config(
            args, max_waiting=args.max_waiting, session_tier_dir=args.session_tier
        ),
        data_dir=Path(args.data_dir),
        api_key=args.api_key,
        keys_file=Path(args.keys) if args.keys else None,
        metrics_key=args.metrics_key,
        batch_concurrency=args.batch_concurrency,
        quota_config=Path(args.quota) if args.quota else None,
        store=args.store,
        batch_lease_s=args.batch_lease_s,
        schema_limits=SchemaLimits(
            properties=args.max_schema_properties,
            depth=args.max_schema_depth,
            enum_values=args.max_schema_enum_values,
            chars=args.max_schema_chars,
            large_enum_chars=args.max_schema_large_enum_chars,
        ),
        responses_keep=args.responses_keep,
        responses_max_age_s=args.responses_max_age_days * 86400.0,
        keep_billing_header=args.keep_billing_header,
    )


def _serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = server_config(args)
    if config is None:
        return 2
    if args.replicas:
        from shoal.cluster.cli import serve_replicas

        return serve_replicas(args, config)
    from shoal.server.app import run_server

    run_server(config, args.host, args.port)
    return 0
